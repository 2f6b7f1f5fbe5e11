"""Gradient reduction bytes per batch axis as hlo_tools counts them on a compiled step:
the quantity accum.cost predicts (packages/accum/README.md, "Which bytes are exact").

Per reduction (all-reduce, reduce-scatter) whose replica groups span a batch
axis, the floating-point arrays of more than 8 elements are counted at their
operand size: an all-reduce's result, a reduce-scatter's result times its group
size (XLA:TPU turns some reduce-scatters into all-reduces; the operand is the
same either way), times the loop trip counts around it. Integer reductions (the
router's token counts) and the loss scalars are left out, as in the placement tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import hlo_tools


def _operand_bytes(c: hlo_tools.Collective) -> int:
    floats = sum(
        a.bytes for a in c.arrays if a.elements > 8 and not a.dtype.startswith(("s", "u", "pred"))
    )
    return floats * ((c.group_size or 1) if c.kind == "reduce-scatter" else 1)


def counted(
    module: hlo_tools.HloModule | str, mesh_shape: Mapping[str, int], axes: Iterable[str]
) -> tuple[dict[str, int], dict[str, int]]:
    """({axis: operand bytes per step inside loops}, {axis: ... outside them}) on a
    single-program (one slice) compile; `mesh_shape`: the ordered axis sizes."""
    axes = tuple(axes)
    inside = {a: 0 for a in axes}
    outside = dict(inside)
    for c in hlo_tools.collectives(module):
        if c.kind not in hlo_tools.REDUCTION_KINDS:
            continue
        spanned = [a for a in axes if hlo_tools.spans_mesh_axis(c, mesh_shape, a)]
        nbytes = _operand_bytes(c) * (c.multiplier or 1)
        for a in spanned:
            (inside if c.in_loop else outside)[a] += nbytes
    return inside, outside


def counted_cross_slice(module: hlo_tools.HloModule | str) -> tuple[int, int]:
    """(in-loop, outside) operand bytes per step of the cross-slice (megascale) gradient
    reductions of one slice's multi-slice TPU program."""
    inside = outside = 0
    for c in hlo_tools.collectives(module):
        if c.cross_slice and c.kind in hlo_tools.REDUCTION_KINDS:
            nbytes = _operand_bytes(c) * (c.multiplier or 1)
            if c.in_loop:
                inside += nbytes
            else:
                outside += nbytes
    return inside, outside


def predicted(run: Any) -> tuple[dict[str, int], dict[str, int]]:
    """accum.cost's (in-loop, after-loop) operand bytes per batch axis for a built
    run (`run.Run`): its plan over the compute-layout parameters."""
    from accum import cost
    from trainer import model as model_lib

    params, _ = model_lib.abstract_state(run.model, run.ctx)
    events = cost.plan_events(
        run.plan,
        params,
        num_microbatches=run.config.gradient_accumulation_steps,
        compute_dtype=run.config.dtype,
        accum_dtype=run.config.accum_dtype,
    )
    plan = run.plan
    return cost.bytes_per_axis(events, plan.batch_axes, dict(plan.mesh_shape), plan.slice_axes)


def exact_axes(run: Any) -> tuple[str, ...]:
    """Batch axes whose in-loop bytes the prediction covers: those that shard only the
    batch dimension (a sequence axis also carries attention's activation reductions,
    which no collective record tells from a gradient's) and that no leaf reduces per
    use (FSDP's reduce-scatters of gathered weights are not the plan's to place)."""
    import accum
    import pspec_tags as pt

    batch_only = set(
        pt.mesh_axes_used(pt.logical_to_spec(("activation_batch",), run.ctx.rules, run.ctx.mesh))
    )
    sequence = set(
        pt.mesh_axes_used(
            pt.logical_to_spec((None, "activation_length"), run.ctx.rules, run.ctx.mesh)
        )
    )
    per_use = set(run.plan.axes(accum.PER_USE))
    return tuple(a for a in run.plan.batch_axes if a in batch_only and a not in sequence | per_use)
