"""What a reduction plan costs: gradient bytes per mesh axis, link time, memory, step time.

Pure Python over a `ReductionPlan` and the parameters' shapes (no compile). The
formulas and their assumptions are in docs/cost_model.md;
which byte figure equals what hlo_tools counts on the compiled program, exactly,
is stated there too.

Per leaf, the plan says when each batch axis is reduced. Each such *event*
reduces one local array over a set of axes:

- `PER_MICROBATCH`: the leaf's local gradient, in the compute dtype (autodiff
  reduces it in the backward pass; a leaf the model uses uncast, in its own f32,
  has an f32 cotangent: `gradient_dtypes`; one the model casts up again at its
  use, like the router's gate, is reduced in that wider dtype: `use_dtypes`; one
  the model reads in a shard_map from a gathered copy, like the embedding table's
  lookup under FSDP, is reduced there over the gathered axes too, at the copy's
  size: `summed_in_use`), GA times per step;
- `SCATTER`: the leaf's local gradient, in the same dtype (the scatter runs on
  the backward pass's cotangent), reduce-scattered over the in-slice axes, GA
  times per step;
- `PER_STEP`: the accumulator (the leaf's layout, or the scattered one under
  hierarchical), in the accumulator dtype, once after the loop;
- a leaf whose reduced gradient the microbatch loop only adds into its
  accumulator (`summed_by_the_loop`: the caller knows the model) has its
  `PER_MICROBATCH` and `SCATTER` events moved after the loop, once each, as XLA's
  loop all-reduce code motion moves them (reduce(a) + reduce(b) = reduce(a + b)):
  an all-reduce keeps its in-loop dtype (XLA casts the f32 sum back to it), a
  reduce-scatter reduces the summed accumulator in the accumulator dtype; not a
  gathered copy's sum, which the loop slices to the shard before adding it;
- `PER_USE` (FSDP's own reduce-scatters, the expert kernel's sums) and `BY_XLA`
  (auto mode) are the same under every policy, or not ours to place: not counted
  (but a use that sums its gathered copy, `summed_in_use`, reduces the gathered
  axes in its per-microbatch event).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from accum.hardware import Hardware
from accum.plan import (
    PER_MICROBATCH,
    PER_USE,
    LeafPlan,
    ReductionPlan,
    _is_leaf_plan,
)
from pspec_tags import entry_axes, mesh_axes_used, partitions

# Arrays of at most this many local elements (scalars, tiny biases) are left out on
# both sides: hlo_tools' gradient filter drops them, as it drops the loss sums.
MIN_ELEMENTS = 9
# XLA:TPU reduces an array across slices after cutting its in-slice sum into one
# shard per device along its tiles (1,024 elements of a vector, 128 of a row); an
# array with no more tiles than devices in the slice crosses whole instead, and one
# of two or more rows always crosses as its shard (docs/cost_model.md, "Across
# slices"; test_aot_crossing.py compiles the line on slices of 4, 8 and 16 chips).
VECTOR_TILE = 1024
ROW_TILE = 128
ICI, DCN = "ICI", "DCN"


@dataclasses.dataclass(frozen=True)
class Event:
    """One reduction of one leaf: `times` per step, over `axes`, of `nbytes` local bytes."""

    axes: tuple[str, ...]
    nbytes: int
    times: int
    scatter: bool  # a reduce-scatter (half a ring all-reduce's wire bytes)
    in_loop: bool
    itemsize: int = 4  # bytes per element of the reduced array
    # The sum is sliced back to the leaf's shard after it (a gathered copy reduced
    # whole: `summed_in_use`), so a loop does not only add it up.
    sliced: bool = False
    # Separate arrays the event reduces per execution, of nbytes / pieces each: a
    # gradient stacked per layer is reduced one layer at a time (`plan_events`).
    pieces: int = 1
    # One piece's local shape, where its in-slice sum is used whole (None: the
    # result is sliced to a shard, or the shape is not known): `crossing_bytes`.
    piece_shape: tuple[int, ...] | None = None

    def crossing_bytes(self, in_slice_group: int) -> int:
        """Bytes one execution sends across slices when the event also spans
        in-slice axes of `in_slice_group` devices: each piece whole where
        `crosses_whole`, else its in-slice shard; pieces of fewer than MIN_ELEMENTS
        elements are left out, as hlo_tools' filter leaves out the array that
        carries them."""
        piece_elements = self.nbytes // self.itemsize // self.pieces
        whole = crosses_whole(self.piece_shape, in_slice_group)
        split = 1 if whole else in_slice_group
        if piece_elements // split < MIN_ELEMENTS:
            return 0
        return self.nbytes // split


def crosses_whole(shape: tuple[int, ...] | None, in_slice_group: int) -> bool:
    """Whether XLA:TPU sends an array of local `shape`, summed inside a slice of
    `in_slice_group` devices and used whole, across slices whole rather than as its
    shard: a vector of at most VECTOR_TILE elements per device, a single row
    (leading dimensions 1) of at most ROW_TILE per device (module constants)."""
    if shape is None:
        return False
    if len(shape) <= 1:
        return math.prod(shape) <= VECTOR_TILE * in_slice_group
    if any(d != 1 for d in shape[:-1]):
        return False
    return shape[-1] <= ROW_TILE * in_slice_group


def moved_after_the_loop(event: Event, accum_bytes: int) -> Event:
    """`event`, a per-microbatch reduction of a gradient the loop only sums, as XLA
    moves it: once, after the loop, on the summed local gradients; a reduce-scatter
    in the accumulator dtype, an all-reduce in its own (module docstring)."""
    item = accum_bytes if event.scatter else event.itemsize
    nbytes = event.nbytes // event.itemsize * item
    return dataclasses.replace(event, nbytes=nbytes, times=1, in_loop=False, itemsize=item)


@dataclasses.dataclass(frozen=True)
class Cost:
    """One policy's predicted figures, per device per optimizer step."""

    policy: str
    bytes_in_loop: dict[str, int]  # batch axis -> reduced operand bytes inside the loop
    bytes_outside: dict[str, int]  # ... after the loop
    link_seconds: dict[str, float]  # ICI / DCN -> wire time of the reductions
    link_bytes: dict[str, float]  # ICI / DCN -> bytes each chip puts on that link (rings)
    hidden_seconds: float  # the part compute hides (see the README's time model)
    exposed_seconds: float
    compute_seconds: float
    step_seconds: float
    dcn_exposed_seconds: float
    accumulator_bytes: int

    @property
    def dcn_share(self) -> float:
        """The share of the predicted step spent waiting on DCN."""
        return self.dcn_exposed_seconds / self.step_seconds if self.step_seconds else 0.0


def local_elements(shape: tuple[int, ...], spec: Any, mesh_shape: Mapping[str, int]) -> int:
    """Elements of one device's shard of an array of `shape` laid out on `spec`."""
    split = math.prod(mesh_shape[a] for a in mesh_axes_used(spec))
    return math.prod(shape) // split


def local_shape(
    shape: tuple[int, ...], spec: Any, mesh_shape: Mapping[str, int], whole: Iterable[str] = ()
) -> tuple[int, ...]:
    """One device's shard shape of an array of `shape` laid out on `spec`, the mesh
    axes in `whole` left unsplit (a copy gathered over them)."""
    kept = set(whole)
    entries = partitions(spec)
    entries += (None,) * (len(shape) - len(entries))  # a short spec leaves the rest whole
    return tuple(
        d // math.prod(mesh_shape[a] for a in entry_axes(e) if a not in kept)
        for d, e in zip(shape, entries, strict=True)
    )


def leaf_events(
    leaf: LeafPlan,
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
    *,
    num_microbatches: int,
    compute_bytes: int,
    accum_bytes: int,
    use_bytes: int | None = None,
    summed_in_use: bool = False,
    summed_by_the_loop: bool = False,
    stacked_per_layer: bool = False,
    zero1: bool = False,
) -> list[Event]:
    """The reductions of one leaf in the compiled step (module docstring); `compute_bytes`:
    the item size of the leaf's gradient in the backward pass; `use_bytes`: that of
    its cotangent at the use, where autodiff's per-microbatch reduction runs, if
    wider (None: `compute_bytes`); `summed_in_use`: the use sums the cotangent of its
    copy over every batch axis at once; `summed_by_the_loop`: the loop only adds its
    reduced gradient into the accumulator (`plan_events`); `stacked_per_layer`: the
    leaf's leading dimension stacks layers, whose gradients the backward pass
    reduces one at a time (its per-microbatch events have as many pieces, each of
    one layer's shape; the accumulator is reduced whole);
    `zero1`: the optimizer updates each device's shard of the leaf (ZeRO-1), so the
    once-per-step reduction is sliced to it and XLA reduce-scatters it inside the
    slice before it crosses, whatever its size."""
    param_elements = local_elements(shape, leaf.param_spec, mesh_shape)
    # Per microbatch the backward pass reduces one layer's array at a time.
    layers, layer = (shape[0], 1) if stacked_per_layer and shape else (1, 0)
    events = []
    if param_elements < MIN_ELEMENTS:
        return events
    per_mb = leaf.axes(PER_MICROBATCH)
    if per_mb:
        # XLA moves the narrowing cast back to the parameter's dtype after the
        # reduction, so the reduction carries the dtype the use computed in.
        item = use_bytes or compute_bytes
        elements = param_elements
        gathered = leaf.axes(PER_USE)
        whole_over = ()
        if item > compute_bytes or summed_in_use:
            # Gathered, then cast up: the transpose reduces the wide cotangent over
            # these axes, casts it, then reduce-scatters the gathered axes; XLA does
            # not reorder the two across the cast, so this runs at the gathered size.
            # Summed in the use: one psum over these axes and the gathered ones.
            elements *= math.prod(mesh_shape[a] for a in gathered)
            whole_over = gathered
        sliced = bool(summed_in_use and gathered)
        if sliced:
            per_mb = leaf.axes(PER_MICROBATCH, PER_USE)
        nbytes = elements * item
        # A gathered copy's sum is sliced to the shard: no piece is used whole.
        piece = (
            None if sliced else local_shape(shape, leaf.param_spec, mesh_shape, whole_over)[layer:]
        )
        events.append(
            Event(per_mb, nbytes, num_microbatches, False, True, item, sliced, layers, piece)
        )
    if leaf.scatter:
        nbytes = param_elements * compute_bytes
        events.append(
            Event(leaf.scatter, nbytes, num_microbatches, True, True, compute_bytes, pieces=layers)
        )
    if leaf.per_step:
        acc_elements = local_elements(shape, leaf.accumulator_spec, mesh_shape)
        nbytes = acc_elements * accum_bytes
        # ZeRO-1 slices the sum to each device's shard: XLA reduce-scatters it
        # inside the slice first, so it crosses as the shard whatever its size.
        whole = None if zero1 else local_shape(shape, leaf.accumulator_spec, mesh_shape)
        events.append(Event(leaf.per_step, nbytes, 1, False, False, accum_bytes, piece_shape=whole))
    if summed_by_the_loop:
        events = [
            moved_after_the_loop(e, accum_bytes) if e.in_loop and not e.sliced else e
            for e in events
        ]
    return events


def plan_events(
    plan: ReductionPlan,
    params: Any,
    *,
    num_microbatches: int,
    compute_dtype: Any,
    accum_dtype: Any,
    gradient_dtypes: Any = None,
    use_dtypes: Any = None,
    summed_in_use: Any = None,
    summed_by_the_loop: Any = None,
    stacked_per_layer: Any = None,
    zero1: bool = False,
) -> list[Event]:
    """Every reduction event of the step (`params`: arrays or ShapeDtypeStructs).

    `gradient_dtypes`: None, or a tree like `params` of the dtype each leaf's
    gradient has in the backward pass where it differs from `compute_dtype` (a
    parameter used in its own f32, like a norm scale or the embedding table, has an
    f32 cotangent); a leaf that is None there takes `compute_dtype`. `use_dtypes`:
    None, or such a tree of the dtype a leaf's use computes in where the model
    casts it up again after the cast to its gradient dtype (the router's gate, in
    f32): its per-microbatch reductions carry that dtype. `summed_in_use`: None, or
    a tree of bools, true for a leaf the model reads inside a shard_map from a copy
    replicated over the batch axes (the embedding table's lookup): its per-microbatch
    reduction is that shard_map's psum, over every batch axis at once at the copy's
    size (gathered over the axes the leaf is sharded on), then sliced to the shard.
    `summed_by_the_loop`: None (nothing moves), or a tree of bools, true for a leaf
    whose reduced per-microbatch gradient the microbatch loop only adds into its
    accumulator (not one stacked per layer by a layer scan that loops): XLA moves
    its per-microbatch reductions after the loop (`moved_after_the_loop`), and
    its events say so. `stacked_per_layer`: None, or a tree of bools, true for a
    leaf whose leading dimension stacks layers: the backward pass reduces its
    gradient one layer at a time, so each per-microbatch event reduces that many
    arrays of a layer's size (which decides how XLA sends them across slices:
    `Event.crossing_bytes`). `zero1`: the optimizer state is sharded over the
    in-slice batch axes (ZeRO-1; `leaf_events`)."""
    sizes = dict(plan.mesh_shape)
    accum_bytes = np.dtype(accum_dtype).itemsize
    leaves = jax.tree.leaves(plan.leaves, is_leaf=_is_leaf_plan)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    if gradient_dtypes is None:
        dtypes = [compute_dtype] * len(shapes)
    else:
        dtypes = jax.tree.leaves(gradient_dtypes, is_leaf=lambda x: x is None)
        dtypes = [compute_dtype if d is None else d for d in dtypes]
    uses = [None] * len(shapes)
    if use_dtypes is not None:
        uses = jax.tree.leaves(use_dtypes, is_leaf=lambda x: x is None)
    summed = [False] * len(shapes)
    if summed_in_use is not None:
        summed = jax.tree.leaves(summed_in_use)
    by_loop = [False] * len(shapes)
    if summed_by_the_loop is not None:
        by_loop = jax.tree.leaves(summed_by_the_loop)
    stacked = [False] * len(shapes)
    if stacked_per_layer is not None:
        stacked = jax.tree.leaves(stacked_per_layer)
    events = []
    rows = zip(leaves, shapes, dtypes, uses, summed, by_loop, stacked, strict=True)
    for leaf, shape, dtype, use, whole, moves, per_layer in rows:
        events += leaf_events(
            leaf,
            shape,
            sizes,
            num_microbatches=num_microbatches,
            compute_bytes=np.dtype(dtype).itemsize,
            accum_bytes=accum_bytes,
            use_bytes=None if use is None else np.dtype(use).itemsize,
            summed_in_use=whole,
            summed_by_the_loop=moves,
            stacked_per_layer=per_layer,
            zero1=zero1,
        )
    return events


def bytes_per_axis(
    events: Iterable[Event],
    batch_axes: Iterable[str],
    mesh_shape: Mapping[str, int] | None = None,
    slice_axes: Iterable[str] = (),
) -> tuple[dict, dict]:
    """({axis: operand bytes per step inside the loop}, {... after it}).

    An event over several axes counts toward each (as a collective whose replica
    groups span them all does in hlo_tools). A cross-slice axis of an event counts
    what crosses the slices (`Event.crossing_bytes`: the in-slice shard of a large
    array, a small one whole)."""
    sliced = set(slice_axes)
    inside = {a: 0 for a in batch_axes}
    outside = dict(inside)
    for e in events:
        g = math.prod(mesh_shape[a] for a in e.axes if a not in sliced) if sliced else 1
        for a in e.axes:
            nbytes = e.crossing_bytes(g) if a in sliced else e.nbytes
            if nbytes < MIN_ELEMENTS * e.itemsize:
                continue
            (inside if e.in_loop else outside)[a] += nbytes * e.times
    return inside, outside


def wire_seconds(
    event: Event, mesh_shape: Mapping[str, int], slice_axes: Iterable[str], hw: Hardware
) -> dict[str, float]:
    """Seconds per execution of `event` on each link (ring collectives).

    In-slice axes: a ring all-reduce puts 2(g-1)/g of the operand on each chip's
    ICI, a reduce-scatter (g-1)/g. Cross-slice axes run on what crosses
    (`Event.crossing_bytes`: the in-slice shard of a large array, as XLA
    reduce-scatters inside the slice, all-reduces across, gathers back; a small
    array whole): 2(s-1)/s of it on each chip's DCN."""
    sliced = set(slice_axes)
    g = math.prod(mesh_shape[a] for a in event.axes if a not in sliced)
    s = math.prod(mesh_shape[a] for a in event.axes if a in sliced)
    ring = (1 if event.scatter else 2) * (g - 1) / g
    out = {ICI: ring * event.nbytes / hw.ici_bytes_per_s, DCN: 0.0}
    if s > 1:
        out[DCN] = 2 * (s - 1) / s * event.crossing_bytes(g) / hw.dcn_bytes_per_s
    return out


def predict(
    plan: ReductionPlan,
    params: Any,
    *,
    num_microbatches: int,
    hardware: Hardware,
    step_flops_per_chip: float,
    compute_dtype: Any = "bfloat16",
    accum_dtype: Any = "float32",
    overlapped_after_loop: bool = False,
    gradient_dtypes: Any = None,
    use_dtypes: Any = None,
    summed_in_use: Any = None,
    summed_by_the_loop: Any = None,
    stacked_per_layer: Any = None,
    zero1: bool = False,
) -> Cost:
    """The plan's predicted cost (formulas: docs/cost_model.md, "Time model").

    `step_flops_per_chip`: the optimizer step's training FLOPs on one chip
    (trainer.model.flops); `overlapped_after_loop`: the after-loop reductions run inside
    the last microbatch's backward pass (schedule 'overlapped_ring': rings are async), so
    they hide under it up to its length; `gradient_dtypes`, `use_dtypes`,
    `summed_in_use`, `summed_by_the_loop`, `stacked_per_layer`, `zero1`: as in
    `plan_events`.
    """
    sizes = dict(plan.mesh_shape)
    events = plan_events(
        plan,
        params,
        num_microbatches=num_microbatches,
        compute_dtype=compute_dtype,
        accum_dtype=accum_dtype,
        gradient_dtypes=gradient_dtypes,
        use_dtypes=use_dtypes,
        summed_in_use=summed_in_use,
        summed_by_the_loop=summed_by_the_loop,
        stacked_per_layer=stacked_per_layer,
        zero1=zero1,
    )
    inside, outside = bytes_per_axis(events, plan.batch_axes, sizes, plan.slice_axes)
    links = {ICI: 0.0, DCN: 0.0}
    loop = {ICI: 0.0, DCN: 0.0}
    for e in events:
        for link, seconds in wire_seconds(e, sizes, plan.slice_axes, hardware).items():
            links[link] += seconds * e.times
            if e.in_loop:
                loop[link] += seconds * e.times
    after = {link: links[link] - loop[link] for link in links}
    compute = step_flops_per_chip / hardware.peak_flops
    last_backward = compute * 2 / 3 / num_microbatches
    after_total = after[ICI] + after[DCN]
    hidden = min(after_total, last_backward) if overlapped_after_loop else 0.0
    exposed = loop[ICI] + loop[DCN] + after_total - hidden
    dcn_after = after[DCN] * (1 - hidden / after_total) if after_total else 0.0
    accumulator = 0
    if num_microbatches > 1:
        item = np.dtype(accum_dtype).itemsize
        leaves = jax.tree.leaves(plan.leaves, is_leaf=_is_leaf_plan)
        for leaf, x in zip(leaves, jax.tree.leaves(params), strict=True):
            accumulator += local_elements(tuple(x.shape), leaf.accumulator_spec, sizes) * item
    return Cost(
        policy=plan.policy,
        bytes_in_loop=inside,
        bytes_outside=outside,
        link_seconds=links,
        link_bytes={
            ICI: links[ICI] * hardware.ici_bytes_per_s,
            DCN: links[DCN] * hardware.dcn_bytes_per_s,
        },
        hidden_seconds=hidden,
        exposed_seconds=exposed,
        compute_seconds=compute,
        step_seconds=compute + exposed,
        dcn_exposed_seconds=loop[DCN] + dcn_after,
        accumulator_bytes=accumulator,
    )
