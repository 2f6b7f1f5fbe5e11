"""Gradient reduction bytes per batch axis as hlo_tools counts them on a compiled step:
the quantity accum.cost predicts (docs/cost_model.md, "Which bytes are exact").

Per reduction (all-reduce, reduce-scatter) whose replica groups span a batch
axis, the floating-point arrays of more than 8 elements are counted at their
operand size, times the loop trip counts around it. The operand is read as the
array the program computed, before XLA:TPU reshaped it into a transfer buffer:
through bitcasts, copies, pads and `ZeroCrop` (which pads an array to whole (8, 128)
tiles for a megascale send), so padding is not counted and a scalar packed
into a 128-lane buffer stays a scalar. Two things that compile to reductions are
not gradient reductions and are left out: an all-reduce whose every operand is a
`dynamic-update-slice` into a broadcast (XLA:TPU's form of a small all-gather,
e.g. ZeRO-1 gathering its updated master shards back), and integer reductions
(the router's token counts) and the loss scalars, as in the placement tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import accum
import hlo_tools
import pspec_tags as pt
from accum import cost
from hlo_tools.collectives import collective_kind, custom_call_target
from hlo_tools.module import Instruction
from hlo_tools.shapes import leaf_arrays
from trainer import model as model_lib
from trainer.step.reduction_choice import cost_inputs, gradient_traits

# Ops that hand an array on unchanged in content (a reshape of the same buffer, a
# copy, an async copy's halves, a pad whose filler is no gradient: XLA pads an operand
# to a size it divides, e.g. deepseek3-small's embedding to 33,152 rows) on its way
# into a collective; each passes on its operand 0.
_PASS_THROUGH = ("bitcast", "copy", "copy-start", "copy-done", "reshape", "pad")
_ALL_REDUCE = ("all-reduce", "all-reduce-start", "all-reduce-done")


def _producer(module: hlo_tools.HloModule, instr: Instruction, index: int = 0):
    """The instruction that defines operand `index` of `instr` (None if not local)."""
    if index >= len(instr.operands):
        return None
    return module.computations[instr.computation].by_name.get(instr.operands[index])


def _logical_source(module: hlo_tools.HloModule, instr: Instruction | None):
    """The array behind `instr` before bitcasts, copies and ZeroCrop's tile padding."""
    while instr is not None:
        if instr.opcode == "get-tuple-element":
            # An element of an earlier reduction's tuple: that reduction's operand
            # (a reduction keeps each operand's shape).
            tuple_of = _producer(module, instr)
            if tuple_of is None or collective_kind(tuple_of.opcode) is None:
                return instr
            instr = _producer(module, tuple_of, int(instr.attributes["index"]))
            continue
        crop = custom_call_target(instr) == "ZeroCrop"
        # An all-reduce keeps its operand's shape: a reduction of its result (a
        # megascale send of an in-slice sum) reads the array it summed.
        summed = instr.opcode in _ALL_REDUCE and len(instr.operands) == 1
        if instr.opcode not in _PASS_THROUGH and not crop and not summed:
            return instr
        operand = _producer(module, instr)
        if operand is not None and _dtypes(operand) != _dtypes(instr):
            # XLA:TPU folds a convert into a copy (f32 -> bf16 with a layout change):
            # the array handed on is the converted one.
            return instr
        instr = operand
    return None


def _dtypes(instr: Instruction) -> tuple[str, ...]:
    return tuple(a.dtype for a in leaf_arrays(instr.type))


def _writes_into_zeros(module: hlo_tools.HloModule, instr: Instruction | None) -> bool:
    """Whether `instr` is a dynamic-update-slice into a broadcast, or a fusion whose
    root (through bitcasts) is one whose base is a broadcast operand of the fusion."""
    if instr is None:
        return False
    if instr.opcode == "dynamic-update-slice":
        base = _logical_source(module, _producer(module, instr))
        return base is not None and base.opcode == "broadcast"
    if instr.opcode != "fusion":
        return False
    fused = module.computations.get(dict(instr.called()).get("calls", ""))
    if fused is None:
        return False
    root = _logical_source(module, fused.root)
    if root is None or root.opcode != "dynamic-update-slice":
        return False
    base = _producer(module, root)
    if base is None or base.opcode != "parameter":
        return False
    outer = _logical_source(module, _producer(module, instr, int(base.literal.strip())))
    return outer is not None and outer.opcode == "broadcast"


def _instruction(module: hlo_tools.HloModule, c: hlo_tools.Collective) -> Instruction:
    return module.computations[c.computation].by_name[c.name]


def is_gather(module: hlo_tools.HloModule, c: hlo_tools.Collective) -> bool:
    """Whether an all-reduce is an all-gather in disguise: each device writes its
    shard into zeros and the sum concatenates them (XLA:TPU's small all-gathers)."""
    if c.kind != "all-reduce" or c.cross_slice:
        return False
    instr = _instruction(module, c)
    return bool(instr.operands) and all(
        _writes_into_zeros(module, _logical_source(module, _producer(module, instr, i)))
        for i in range(len(instr.operands))
    )


def _float_bytes(arrays) -> int:
    return sum(
        a.bytes for a in arrays if a.elements > 8 and not a.dtype.startswith(("s", "u", "pred"))
    )


def _operand_bytes(module: hlo_tools.HloModule, c: hlo_tools.Collective) -> int:
    """Gradient operand bytes of one reduction (module docstring). Where an operand
    has no local definition, the result stands for it: an all-reduce's, a
    reduce-scatter's times its group."""
    instr = _instruction(module, c)
    operands = range(1 if c.cross_slice else len(instr.operands))  # a send: value, token
    sources = [_parts(module, _producer(module, instr, i)) for i in operands]
    if sources and all(None not in parts for parts in sources):
        return sum(_float_bytes(leaf_arrays(s.type)) for parts in sources for s in parts)
    return _float_bytes(c.arrays) * ((c.group_size or 1) if c.kind == "reduce-scatter" else 1)


def _parts(module: hlo_tools.HloModule, instr: Instruction | None) -> list:
    """The arrays behind an operand: its logical source, or, where XLA concatenated
    several arrays into one buffer (hierarchical's cross-slice sends), each of them.
    A parameter of the computation the reduction sits in (a fusion's, a wrapper's)
    is the array handed in, before any pad inside; None marks an operand with no
    local definition."""
    source = _logical_source(module, instr)
    if source is None:
        return [None]
    if source.opcode == "concatenate":
        return [
            p
            for i in range(len(source.operands))
            for p in _parts(module, _producer(module, source, i))
        ]
    return [source]


def gradient_reductions(module: hlo_tools.HloModule | str):
    """(collective record, gradient operand bytes per execution) of every reduction
    that can carry a gradient: all-reduces and reduce-scatters in the program and
    across slices, less the gathers in disguise (`is_gather`)."""
    module = hlo_tools.parse(module) if isinstance(module, str) else module
    out = []
    for c in hlo_tools.collectives(module):
        if c.kind in hlo_tools.REDUCTION_KINDS and not is_gather(module, c):
            out.append((c, _operand_bytes(module, c)))
    return out


def counted(
    module: hlo_tools.HloModule | str, mesh_shape: Mapping[str, int], axes: Iterable[str]
) -> tuple[dict[str, int], dict[str, int]]:
    """({axis: operand bytes per step inside loops}, {axis: ... outside them}) of the
    collectives inside one program (a multi-slice program's in-slice ones; its
    megascale sends are `counted_cross_slice`'s); `mesh_shape`: the ordered axis
    sizes (of one slice's devices and the dcn_ axes: replica groups name the
    program's own devices)."""
    axes = tuple(axes)
    inside = {a: 0 for a in axes}
    outside = dict(inside)
    for c, operand_bytes in gradient_reductions(module):
        if c.cross_slice:
            continue  # the megascale sends: counted_cross_slice
        spanned = [a for a in axes if hlo_tools.spans_mesh_axis(c, mesh_shape, a)]
        nbytes = operand_bytes * (c.multiplier or 1)
        for a in spanned:
            (inside if c.in_loop else outside)[a] += nbytes
    return inside, outside


def counted_cross_slice(module: hlo_tools.HloModule | str) -> tuple[int, int]:
    """(in-loop, outside) operand bytes per step of the cross-slice (megascale) gradient
    reductions of one slice's multi-slice TPU program."""
    inside = outside = 0
    for c, operand_bytes in gradient_reductions(module):
        if c.cross_slice:
            nbytes = operand_bytes * (c.multiplier or 1)
            if c.in_loop:
                inside += nbytes
            else:
                outside += nbytes
    return inside, outside


def events(run: Any) -> list:
    """accum.cost's events for a built run (`run.Run`): its plan over the
    compute-layout parameters, with the model's gradient traits, the per-microbatch
    reductions XLA moves after the loop among them (docs/cost_model.md)."""
    params, _ = model_lib.abstract_state(run.model, run.ctx)
    traits = gradient_traits(run.model, params)
    return cost.plan_events(
        run.plan,
        params,
        num_microbatches=run.config.gradient_accumulation_steps,
        compute_dtype=run.config.dtype,
        accum_dtype=run.config.accum_dtype,
        **cost_inputs(
            traits,
            params,
            run.plan,
            run.config.model,
            run.config.parallelism,
            run.config.accumulation,
        ),
    )


def predicted(run: Any) -> tuple[dict[str, int], dict[str, int]]:
    """accum.cost's (in-loop, after-loop) operand bytes per batch axis for a built
    run (`events`): what `counted` finds on its compiled step."""
    plan = run.plan
    return cost.bytes_per_axis(events(run), plan.batch_axes, dict(plan.mesh_shape), plan.slice_axes)


def exact_axes(run: Any) -> tuple[str, ...]:
    """Batch axes whose in-loop bytes the prediction covers: those that shard only the
    batch dimension (a sequence axis also carries attention's activation reductions,
    which no collective record tells from a gradient's) and that no leaf reduces per
    use (FSDP's reduce-scatters of gathered weights are not the plan's to place)."""
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
