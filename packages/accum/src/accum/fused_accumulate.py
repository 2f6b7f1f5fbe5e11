"""One microbatch's gradients added into the accumulator inside the backward pass.

The plan's schedule is unchanged; only where the additions (and, on the last
microbatch of an overlapped schedule, the reductions) happen moves: into the backward
layer scan of `accum.scan_layers` for stacked parameters, after the backward
pass for the others (as `accumulate_gradients` always does).

Each layer's gradient is type-checked as it is added (unreduced over the leaf's
tagged axes). Like every trace-time check that check only explains: inside
`accum.compile_checked` it names suspects for the compiled verdict's message,
inside a user's own jit it warns; the compiled program decides (accum.verdict).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from accum.fused import fused_value_and_grad, sink_type
from accum.guard import report_dropped_tags
from accum.layer_slices import leading_unsharded, without_leading
from accum.overlapped import ring_key, ring_place
from accum.plan import LeafPlan, ReductionPlan, is_floating
from accum.sink_leaf import SinkLeaf
from accum.tags import as_spec, is_target_leaf, place, scatter_leaf
from pspec_tags import find_untagged, spec_of, untagged


def _final_spec(acc: jax.Array, target: Any) -> P | None:
    """The reduced gradient's stacked spec: `target`'s, else the accumulator's partitions."""
    spec = as_spec(target)
    if spec is None:
        own = spec_of(acc)
        return None if own is None else untagged(own)
    return untagged(spec)


def _check_layer_gradient(d: jax.Array, leaf: LeafPlan, path: str, on_tag_lost: str) -> None:
    """Report a layer gradient not typed unreduced over the leaf's tagged axes:
    a suspect for `compile_checked`'s message, else a warning; never an error
    (the compiled program, not the type, says whether a reduction runs here)."""
    if not find_untagged(d, leaf.tagged):
        return
    why = f"a layer's gradient {jax.typeof(d)} is not typed unreduced over {leaf.tagged}"
    report_dropped_tags({path: [why]}, leaf.tagged, on_tag_lost)


def _prepare(
    leaf: LeafPlan, mode: str, slice_target: P | None, path: str = "", on_tag_lost: str = "warn"
) -> Callable:
    """A layer's gradient made addable to its accumulator slice: its type checked
    (`_check_layer_gradient`, at trace time), reduce-scattered over its scatter axes."""

    def prepare(d):
        if mode == "explicit" and leaf.tagged and on_tag_lost != "ignore":
            _check_layer_gradient(d, leaf, path, on_tag_lost)
        if leaf.scatter and slice_target is not None:
            # Same barrier as scatter_into: keeps XLA from sinking the
            # reduce-scatter out of the loop into a full-size accumulator.
            return lax.optimization_barrier(scatter_leaf(leaf, d, slice_target))
        return d

    return prepare


def make_entries(
    plan: ReductionPlan,
    params: Any,
    acc: Any,
    targets: Any,
    ring: bool = False,
    on_tag_lost: str = "warn",
) -> list:
    """A SinkLeaf per stackable parameter leaf (floating, layer axis unsharded), else
    None, in the parameters' flattened order.

    `targets`: None to accumulate; else the per-leaf list of where the last
    microbatch reduces the total (NamedSharding, PartitionSpec, or None for the
    accumulator's own partitions). `ring`: reduce-scatters onto those targets go
    as rings of collective-permutes (accum.ring). `on_tag_lost`: how a layer
    gradient's type check reports (warn / ignore; never raises).
    """
    mode = plan.mode
    treedef = jax.tree.structure(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    param_leaves = treedef.flatten_up_to(params)
    acc_leaves = treedef.flatten_up_to(acc)
    target_leaves = [None] * len(param_leaves) if targets is None else targets

    def entry(leaf: LeafPlan, path: str, p, a, target):
        if not is_floating(p) or p.ndim == 0:
            return None
        if not leading_unsharded(spec_of(p)) or not leading_unsharded(spec_of(a)):
            return None
        final_stacked = None
        if targets is not None:
            final_stacked = _final_spec(a, target)
            if final_stacked is not None and not leading_unsharded(final_stacked):
                return None  # the layer axis is sharded: reduced after the pass
        final = None
        if targets is not None:
            final = without_leading(final_stacked) if final_stacked is not None else P()
        return SinkLeaf(
            acc=a,
            final=final,
            prepare=_prepare(leaf, mode, without_leading(spec_of(a)), path, on_tag_lost),
            place=lambda x, t: place(x, t, mode),
            sink=sink_type(a, final_stacked),
            ring=ring and mode == "explicit",
        )

    return [
        entry(*args)
        for args in zip(plan.leaf_list, paths, param_leaves, acc_leaves, target_leaves, strict=True)
    ]


def target_leaves(targets: Any, params: Any) -> list:
    """`targets` (None: each leaf on its accumulator's partitions) as a flat list."""
    treedef = jax.tree.structure(params)
    if targets is None:
        return [None] * treedef.num_leaves
    return (
        jax.tree.leaves(targets, is_leaf=is_target_leaf)
        if not isinstance(targets, list)
        else targets
    )


def fused_microbatch(
    loss_fn: Callable,
    params: Any,
    args: tuple,
    plan: ReductionPlan,
    acc: Any,
    *,
    final: bool = False,
    targets: Any = None,
    ring: bool = False,
    on_tag_lost: str = "warn",
) -> tuple[jax.Array, dict, Any]:
    """(loss_sum, aux, new_acc) of one microbatch, gradients added inside the backward.

    `final=False`: `new_acc` is the running accumulator. `final=True`: this is
    the step's last microbatch and `new_acc` holds the reduced gradients on
    `targets` (a tree of NamedSharding/PartitionSpec/None; None: each
    accumulator's own partitions): stacked leaves reduced layer by layer inside
    the backward pass, the rest right after it; with `ring`, the stacked leaves'
    reduce-scatters as rings of collective-permutes. `on_tag_lost`: as in
    `accumulate_gradients`; the layer gradients' type check warns at most.
    """
    mode = plan.mode
    treedef = jax.tree.structure(params)
    finals = target_leaves(targets, params) if final else None
    entries = make_entries(plan, params, acc, finals, ring, on_tag_lost)
    (loss_sum, aux), grads, sink_cts = fused_value_and_grad(loss_fn, params, args, entries)
    acc_leaves = treedef.flatten_up_to(acc)
    grad_leaves = treedef.flatten_up_to(grads)
    finals = finals if final else [None] * len(acc_leaves)
    new = []
    for leaf, a, g, e, s, target in zip(
        plan.leaf_list, acc_leaves, grad_leaves, entries, sink_cts, finals, strict=True
    ):
        # A claim whose backward never ran returned no accumulator (accum.fused):
        # the leaf is added the ordinary way.
        claimed = e is not None and e.claimed and e.sink_ran
        # The ordinary gradient: of an unclaimed leaf, or of a claimed leaf's
        # uses outside scan_layers (seen by its probe).
        extra = None
        if not claimed or e.used_elsewhere:
            extra = scatter_leaf(leaf, g, spec_of(a)) if leaf.scatter else g
        if claimed:
            if extra is not None:
                extra = place(extra, target, mode) if final else extra
                s = s + extra.astype(s.dtype)
            new.append(s)
            continue
        total = a + extra.astype(a.dtype)
        if final and ring and mode == "explicit":
            new.append(_ring_or_place(total, target, mode))
        else:
            new.append(place(total, target, mode) if final else total)
    return loss_sum, aux, jax.tree.unflatten(treedef, new)


def _ring_or_place(total: jax.Array, target: Any, mode: str) -> jax.Array:
    """An unstacked leaf's reduction onto `target`: a ring of its own where it is a
    ZeRO-1 reduce-scatter (one per leaf, so each starts as soon as its gradient is
    final: the output head's at the top of the backward), else `place`."""
    final = _final_spec(total, target)
    if final is None or ring_key(total, final) is None:
        return place(total, target, mode)
    (reduced,) = ring_place([total], [final])
    return reduced
