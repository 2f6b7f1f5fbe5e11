"""accum: gradient accumulation under one reduction plan (deferred, per microbatch or
hierarchical across slices), and ZeRO-1."""

from accum.accumulate import ON_TAG_LOST, accumulate_gradients
from accum.dispatch import Accumulator, add, finish, start
from accum.fused import scan_layers
from accum.gating import (
    batch_axes_of,
    data_is_only_batch_axis,
    deferred_axes,
    param_mesh_axes,
    plan_for_values,
    resolve_mode,
)
from accum.guard import find_dropped_tags
from accum.microbatch import split_microbatches
from accum.plan import (
    BY_XLA,
    PER_MICROBATCH,
    PER_STEP,
    PER_USE,
    POLICIES,
    SCATTER,
    LeafPlan,
    PlanError,
    ReductionPlan,
    make_plan,
)
from accum.step import apply_updates, train_step
from accum.tags import tag_reduced, unreduced_zeros
from accum.zero1 import (
    check_zero1_compatible,
    zero1_shardings,
    zero1_state_shardings,
    zero1_step,
)

__version__ = "0.1.0"

__all__ = [
    "BY_XLA",
    "ON_TAG_LOST",
    "PER_MICROBATCH",
    "PER_STEP",
    "PER_USE",
    "POLICIES",
    "SCATTER",
    "Accumulator",
    "LeafPlan",
    "PlanError",
    "ReductionPlan",
    "accumulate_gradients",
    "add",
    "apply_updates",
    "batch_axes_of",
    "check_zero1_compatible",
    "data_is_only_batch_axis",
    "deferred_axes",
    "find_dropped_tags",
    "finish",
    "make_plan",
    "param_mesh_axes",
    "plan_for_values",
    "resolve_mode",
    "scan_layers",
    "split_microbatches",
    "start",
    "tag_reduced",
    "train_step",
    "unreduced_zeros",
    "zero1_shardings",
    "zero1_state_shardings",
    "zero1_step",
]
