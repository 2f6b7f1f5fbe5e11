"""accum: gradient accumulation under one reduction plan (deferred, per microbatch or
hierarchical across slices) and one schedule (plain, fused, overlapped), and ZeRO-1.

The examples in the docstrings start from this setup: 8 devices (on CPU, set
`jax.config.update("jax_num_cpu_devices", 8)` first), a replicated parameter and
a batch sharded over 'data'; `tests/test_doctests.py` runs them all.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
>>> import accum
>>> import pspec_tags as pt
>>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
>>> w = jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))
>>> batch = {"x": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))}
>>> def loss_fn(w, mb):  # (sum of row losses, {"weight": rows counted})
...     return jnp.sum(mb["x"] @ w), {"weight": jnp.float32(mb["x"].shape[0])}
>>> class SGD:  # any optax-style optimizer
...     def update(self, grads, state, params=None):
...         return jax.tree.map(lambda g: -0.5 * g, grads), state
"""

from accum.accumulate import accumulate_gradients
from accum.dispatch import Accumulator, add, finish, start
from accum.fused import scan_layers
from accum.gating import (
    batch_axes_of,
    data_is_only_batch_axis,
    deferred_axes,
    param_mesh_axes,
    plan_for,
    resolve_mode,
)
from accum.guard import find_dropped_tags
from accum.microbatch import split_microbatches
from accum.paths import choose_path
from accum.plan import (
    BY_XLA,
    PATHS,
    PER_MICROBATCH,
    PER_STEP,
    PER_USE,
    POLICIES,
    SCATTER,
    LeafPlan,
    PlanError,
    ReductionPlan,
    make_plan,
    reduced_at_use,
)
from accum.schedule import SCHEDULES, check_schedule, fuses_in_scan
from accum.step import apply_updates, optimizer_update, train_step
from accum.tags import tag_reduced, unreduced_zeros
from accum.verdict import ON_TAG_LOST, check_compiled, compile_checked, in_loop_reductions
from accum.zero1 import (
    check_zero1_compatible,
    zero1_gather,
    zero1_shardings,
    zero1_state_shardings,
    zero1_step,
)

__version__ = "0.1.0"

__all__ = [
    "BY_XLA",
    "ON_TAG_LOST",
    "PATHS",
    "PER_MICROBATCH",
    "PER_STEP",
    "PER_USE",
    "POLICIES",
    "SCATTER",
    "SCHEDULES",
    "Accumulator",
    "LeafPlan",
    "PlanError",
    "ReductionPlan",
    "accumulate_gradients",
    "add",
    "apply_updates",
    "batch_axes_of",
    "check_compiled",
    "check_schedule",
    "check_zero1_compatible",
    "choose_path",
    "compile_checked",
    "data_is_only_batch_axis",
    "deferred_axes",
    "find_dropped_tags",
    "finish",
    "fuses_in_scan",
    "in_loop_reductions",
    "make_plan",
    "optimizer_update",
    "param_mesh_axes",
    "plan_for",
    "reduced_at_use",
    "resolve_mode",
    "scan_layers",
    "split_microbatches",
    "start",
    "tag_reduced",
    "train_step",
    "unreduced_zeros",
    "zero1_gather",
    "zero1_shardings",
    "zero1_state_shardings",
    "zero1_step",
]
