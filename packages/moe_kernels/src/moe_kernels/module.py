"""`MoE`: the Flax NNX module around `sparse_moe`/`dense_moe`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from moe_kernels import lora
from moe_kernels.config import DEFAULT_RULES, MoEConfig
from moe_kernels.layer import dense_moe, sparse_moe
from moe_kernels.params import init_params, param_specs
from moe_kernels.routing import update_routing_bias
from moe_kernels.shard_plan import ManualExperts


class RoutingBias(nnx.Variable):
    """DeepSeek-V3 aux-loss-free balancing bias: moved by load statistics
    (`MoE.update_bias`), never by the optimizer (filter `nnx.Param` for that)."""


class MoE(nnx.Module):
    """DeepSeek-style MoE layer: router, routed SwiGLU experts, shared experts.

    Every parameter carries its logical axis names (`config.param_axes`, e.g.
    ('exp', 'embed', 'mlp') for `wi_0`) as NNX sharding metadata, without eager
    sharding: the trainer places them with its own rules (`nnx.get_partition_spec`
    gives the names), or pass `mesh` (+ `rules`) here to place them with
    `param_specs`. `sparse` switches between `sparse_moe` and `dense_moe`.
    Calling it returns `(y_BxSxD, stats)`.

    A framework with its own parameter bookkeeping (the trainer) passes
    `metadata(name, shape, logical_axes) -> dict`: the metadata each variable
    gets instead of `out_sharding`/`eager_sharding`; `place=False` keeps `mesh`
    for the call only (parameters are placed by the caller); `dtype` casts the
    weights to the compute dtype at use; `recompute_casts` goes to the layer.

    Inside a caller's fully manual shard_map: `mesh=None`, `manual=ManualExperts(...)`
    where it shards the experts and `device` its mesh's (see `sparse_moe`). The
    parameters are still created whole; the caller hands the layer its shard.
    """

    def __init__(
        self,
        config: MoEConfig,
        embed_dim: int,
        *,
        rngs: nnx.Rngs,
        sparse: bool = True,
        mesh: Any = None,
        rules: Any = None,
        mode: str | None = None,
        param_dtype: Any = jnp.float32,
        dtype: Any = None,
        metadata: Callable[[str, tuple, tuple], dict] | None = None,
        place: bool = True,
        recompute_casts: bool = True,
        manual: ManualExperts | None = None,
        device: Any = None,
    ):
        self.config = config
        self.sparse = sparse
        self.mesh = mesh
        self.rules = DEFAULT_RULES if rules is None else rules
        self.mode = mode
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.recompute_casts = recompute_casts
        self.manual, self.device = manual, device
        values = init_params(rngs.params(), config, embed_dim, param_dtype)
        if mesh is not None and place:
            specs = param_specs(config, self.rules, mesh, {n: v.shape for n, v in values.items()})
            # TAG: fresh parameters carry no tags (accum tags them each step);
            # placement only decides partitions.
            values = {
                n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in values.items()
            }
        axes = config.logical_axes
        for name, value in values.items():
            kind = RoutingBias if name == "bias" else nnx.Param
            # TAG: logical axes only (no tag): accum tags the parameter each step.
            meta = (
                dict(out_sharding=axes[name], eager_sharding=False)
                if metadata is None
                else metadata(name, tuple(value.shape), tuple(axes[name]))
            )
            setattr(self, name, kind(value, **meta))

    def params(self) -> dict[str, jax.Array]:
        """The current parameter values by name (what `sparse_moe` takes), LoRA
        factors included where a caller attached them (`moe_kernels.lora`)."""
        names = (*self.config.logical_axes, *lora.param_names())
        return {n: getattr(self, n)[...] for n in names if hasattr(self, n)}

    def _call_params(self) -> dict[str, jax.Array]:
        out = {}
        for name, value in self.params().items():
            # The bias only selects experts; it must not receive a gradient.
            if name == "bias":
                out[name] = jax.lax.stop_gradient(value)
            else:
                out[name] = value if self.dtype is None else value.astype(self.dtype)
        return out

    def __call__(self, x_BxSxD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        fn = sparse_moe if self.sparse else dense_moe
        return fn(
            x_BxSxD,
            self._call_params(),
            config=self.config,
            mesh=self.mesh,
            rules=self.rules,
            mode=self.mode,
            recompute_casts=self.recompute_casts,
            manual=self.manual,
            device=self.device,
        )

    def update_bias(self, tokens_per_expert_E: jax.Array, *, rate: float) -> None:
        """Aux-loss-free balancing step from one optimizer step's total load."""
        self.bias[...] = update_routing_bias(self.bias[...], tokens_per_expert_E, rate=rate)
