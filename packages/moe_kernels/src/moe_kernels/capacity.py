"""What `capacity_factor` means on a given mesh: the path a layer takes and its row cap.

`capacity_plan(config, x_shape, mesh, rules)` reads the same sharding plan the
layer builds (moe_kernels.shard_plan, from shapes only) and says, for one call on an
activation of `x_shape` (a microbatch), how many assignments a token shard
routes, which dispatch path runs, and how many rows the cap allows: the
trainer prints it at startup so that a cap is never a silent no-op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moe_kernels import dispatch
from moe_kernels.config import DEFAULT_RULES, MoEConfig
from moe_kernels.params import param_shapes
from moe_kernels.shard_plan import shard_plan


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """One layer call's dispatch, per token shard.

    path: 'all_to_all' (tokens sharded over the expert axis) or 'local'.
    assignments: T*Z, the tokens of one shard times experts per token.
    ep: expert-parallel degree; num_experts: E.
    rows: the cap (per all-to-all block, or per expert on the local path);
        None when capacity_factor is 0 on the local path (no cap at all).
    fair_share: assignments / ep (per block) or / E (per expert).
    """

    capacity_factor: float
    path: str
    assignments: int
    ep: int
    num_experts: int
    rows: int | None
    fair_share: float

    def describe(self) -> str:
        """One line for a startup printout."""
        cf, a = self.capacity_factor, self.assignments
        if self.path == "all_to_all":
            unit = (
                "each expert-parallel all-to-all block (token shard -> expert shard, "
                f"{self.ep} per shard)"
            )
            if not cf:
                return (
                    f"moe capacity: capacity_factor=0, no token dropped: {unit} is padded "
                    f"to all {a} assignments of a token shard (fair share {self.fair_share:g})"
                )
            return (
                f"moe capacity: capacity_factor={cf:g} caps {unit} at {self.rows} rows "
                f"of a token shard's {a} assignments (fair share {a}/{self.ep} = "
                f"{self.fair_share:g}); overflow dropped, reported as moe/dropped_share"
            )
        if not cf:
            return "moe capacity: capacity_factor=0, no token dropped (local experts path)"
        return (
            f"moe capacity: capacity_factor={cf:g} caps each of the {self.num_experts} experts "
            f"at {self.rows} of a token shard's {a} assignments (fair share {a}/"
            f"{self.num_experts} = {self.fair_share:g}; local experts path, no all-to-all); "
            "overflow dropped, reported as moe/dropped_share"
        )


def capacity_plan(
    config: MoEConfig,
    x_shape: tuple[int, int, int],
    mesh: Any = None,
    rules: Any = None,
    *,
    sparse: bool = True,
) -> CapacityPlan:
    """The dispatch path and row cap of a layer call on `x_shape` (B, S, D);
    `sparse=False`: dense_moe's (always the local cap: no all-to-all).

    >>> from moe_kernels import MoEConfig
    >>> from moe_kernels.capacity import capacity_plan
    >>> plan = capacity_plan(MoEConfig(num_experts=8, capacity_factor=1.25), (2, 16, 32))
    >>> plan.path, plan.assignments, plan.rows
    ('local', 64, 10)
    """
    b, s, d = x_shape
    ep, a2a, tokens = 1, False, b * s
    if mesh is not None:
        x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
        params = {
            n: jax.ShapeDtypeStruct(shape, jnp.float32)
            for n, shape in param_shapes(config, d).items()
        }
        rules = DEFAULT_RULES if rules is None else rules
        plan = shard_plan(x, params, config, mesh, rules, "auto", False, sparse)
        sizes = dict(mesh.shape)
        shards = 1
        for axis in plan.token_axes:
            shards *= sizes[axis]
        ep, a2a, tokens = plan.ep, plan.a2a, b * s // shards
    assignments = tokens * config.num_experts_per_tok
    if a2a:
        rows = dispatch.block_capacity(config, assignments, ep)
        return CapacityPlan(
            config.capacity_factor,
            "all_to_all",
            assignments,
            ep,
            config.num_experts,
            rows,
            assignments / ep,
        )
    rows = dispatch.local_capacity(config, assignments)
    return CapacityPlan(
        config.capacity_factor, "local", assignments, ep, config.num_experts, rows,
        assignments / config.num_experts,
    )  # fmt: skip
