"""The fused layer stack: a `custom_vjp` scan whose backward updates accumulators.

`fused_scan` is what `accum.scan_layers` runs when some stacked leaves are
claimed by the accumulation context (accum.fused). Read it in this order:

1. `_StackLayout`: the stacked leaves divide into *sunk* (claimed: gradient goes
   into an accumulator), *free* (other floating leaves: gradient returned as
   usual) and *fixed* (integer leaves: no gradient).
2. `_close_layer`: `body` with the values it closes over made explicit inputs.
3. `_layer_stack`: the `custom_vjp`. Forward: the plain scan, saving each
   layer's VJP residuals (`_Residuals`: those that are the layer's own inputs
   are re-read in the backward instead of saved twice).
4. `_backward`: the reverse scan. Each iteration (`_BackwardStep`) runs one
   layer's VJP and adds the sunk gradients into the accumulators' slices. On the
   step's last microbatch (`_overlapped_backward`) it also reduces the layer
   above's finished total (accum.overlapped), pipelined by one layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from accum.layer_slices import (
    add_at,
    concat,
    holds_result,
    read_results,
    set_at,
    slice_at,
    stack_one,
    store_result,
    zeros_like_type,
)
from accum.overlapped import layer_totals, reduce_layer
from accum.plan import is_floating
from accum.sink_leaf import SinkLeaf
from pspec_tags import spec_of


def _split(items: list, mask: list[bool]) -> tuple[list, list]:
    return [x for x, m in zip(items, mask, strict=True) if m], [
        x for x, m in zip(items, mask, strict=True) if not m
    ]


def _merge(yes: list, no: list, mask: list[bool]) -> list:
    yes_it, no_it = iter(yes), iter(no)
    return [next(yes_it) if m else next(no_it) for m in mask]


@dataclasses.dataclass(frozen=True)
class _StackLayout:
    """Which flattened stacked leaves are sunk, free or fixed, and how one layer's
    slices of the three lists reassemble into `body`'s layer argument."""

    tree: Any
    sunk_mask: list[bool]
    free_mask: list[bool]  # over the leaves that are not sunk: floating ones

    @staticmethod
    def of(leaves: list, tree: Any, entries: list) -> _StackLayout:
        sunk_mask = [e is not None for e in entries]
        float_mask = [is_floating(x) for x in leaves]
        free_mask = [f for f, s in zip(float_mask, sunk_mask, strict=True) if not s]
        return _StackLayout(tree, sunk_mask, free_mask)

    def split(self, leaves: list) -> tuple[list, list, list]:
        """(free, sunk, fixed) leaves."""
        sunk, rest = _split(leaves, self.sunk_mask)
        free, fixed = _split(rest, self.free_mask)
        return free, sunk, fixed

    def layer_input(self, free_i: list, sunk_i: list, fixed_i: list) -> Any:
        """`body`'s layer argument from one layer's slices."""
        rest = _merge(free_i, fixed_i, self.free_mask)
        return jax.tree.unflatten(self.tree, _merge(sunk_i, rest, self.sunk_mask))


def _close_layer(body: Callable, carry: Any, layout: _StackLayout, stacks: tuple) -> tuple:
    """(layer, consts): `layer(c, free_i, sunk_i, consts, fixed_i)` is `body` on one
    layer with the values `body` closes over passed in as `consts`, so their
    cotangents (shared weights, for instance) are summed over layers here."""
    free, sunk, fixed = stacks
    example = layout.layer_input([x[0] for x in free], [x[0] for x in sunk], [x[0] for x in fixed])
    closed_body, consts = jax.closure_convert(body, carry, example)

    def layer(c, free_i, sunk_i, consts_, fixed_i):
        return closed_body(c, layout.layer_input(free_i, sunk_i, fixed_i), *consts_)

    return layer, consts


class _Residuals:
    """Which of a layer's VJP residuals the forward saves. Residuals that are the
    layer's own inputs are read from the stack (or the constants) in the
    backward scan instead of being saved twice.

    `save` runs while the forward scan's body is traced and records the
    residuals' structure; `rebuild` (the backward, traced later) reads it. The
    structure exists only once the forward is traced, hence this record."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.where: list[tuple[str, int | None]] = []

    def save(self, vjp_fn: Callable, free_i: list, sunk_i: list, consts_: Any) -> list:
        """The residuals of `vjp_fn` to save (the others are recorded by source)."""
        res, self.tree = jax.tree.flatten(vjp_fn)
        sources = {id(x): ("free", k) for k, x in enumerate(free_i)}
        sources.update({id(x): ("sunk", k) for k, x in enumerate(sunk_i)})
        sources.update({id(x): ("const", k) for k, x in enumerate(jax.tree.leaves(consts_))})
        self.where = [sources.get(id(r), ("saved", None)) for r in res]
        return [r for r, w in zip(res, self.where, strict=True) if w[0] == "saved"]

    def rebuild(self, saved_i: list, free_i: list, sunk_i: list, consts_: Any) -> Callable:
        """The layer's VJP function from its saved residuals and its inputs."""
        saved_it = iter(saved_i)
        pools = {"free": free_i, "sunk": sunk_i, "const": jax.tree.leaves(consts_)}
        res = [next(saved_it) if w[0] == "saved" else pools[w[0]][w[1]] for w in self.where]
        return jax.tree.unflatten(self.tree, res)


def _layer_stack(layer: Callable, fixed: list, active: list[SinkLeaf]) -> Callable:
    """`stack(carry, free, sunk, consts, accs, sinks) -> (carry, ys)`: the layer scan
    whose backward returns the new accumulators as the cotangents of `sinks`."""
    residuals = _Residuals()

    def forward(c, xs_i, consts_):
        free_i, sunk_i, fixed_i = xs_i
        out, vjp_fn = jax.vjp(
            lambda c_, f_, s_, k_: layer(c_, f_, s_, k_, fixed_i), c, free_i, sunk_i, consts_
        )
        saved = residuals.save(vjp_fn, free_i, sunk_i, consts_)
        new_c, y = out
        return new_c, (y, saved)

    @jax.custom_vjp
    def stack(c, free_, sunk_, consts_, accs_, sinks_):
        del accs_, sinks_
        return lax.scan(
            lambda c_, xs: layer(c_, xs[0], xs[1], consts_, xs[2]), c, (free_, sunk_, fixed)
        )

    def stack_fwd(c, free_, sunk_, consts_, accs_, sinks_):
        del sinks_
        c_out, (ys, saved) = lax.scan(
            lambda c_, xs: forward(c_, xs, consts_), c, (free_, sunk_, fixed)
        )
        return (c_out, ys), (saved, free_, sunk_, consts_, accs_)

    def stack_bwd(res, cts):
        return _backward(active, residuals, res, cts)

    stack.defvjp(stack_fwd, stack_bwd)
    return stack


def fused_scan(body: Callable, carry: Any, leaves: list, tree: Any, entries: list) -> Any:
    """`lax.scan(body, carry, unflatten(tree, leaves))` whose backward adds each
    claimed leaf's gradient (`entries[k]`, a SinkLeaf, else None) into its
    accumulator, layer by layer."""
    layout = _StackLayout.of(leaves, tree, entries)
    free, sunk, fixed = layout.split(leaves)
    active = [e for e in entries if e is not None]
    layer, consts = _close_layer(body, carry, layout, (free, sunk, fixed))
    stack = _layer_stack(layer, fixed, active)
    sinks = [e.sink for e in active]
    # The accumulators enter as inputs (residuals of the backward), not as closures.
    return stack(carry, free, sunk, consts, [e.acc for e in active], sinks)


@dataclasses.dataclass(frozen=True)
class _LayerCotangents:
    """The cotangents of the scan's per-layer outputs `ys`, split into the scanned
    ones and the float0 ones (of integer outputs such as counts), which are
    rebuilt per layer rather than scanned."""

    tree: Any
    scanned_mask: list[bool]
    scanned: list
    zero_slices: list

    @staticmethod
    def of(ct_ys: Any) -> _LayerCotangents:
        leaves, tree = jax.tree.flatten(ct_ys)
        scanned_mask = [x.dtype != jax.dtypes.float0 for x in leaves]
        scanned, zeros = _split(leaves, scanned_mask)
        # float0 cotangents are host arrays: one layer's is a slice of them.
        return _LayerCotangents(tree, scanned_mask, scanned, [x[0] for x in zeros])

    def of_layer(self, scanned_i: list) -> Any:
        """One layer's cotangent of `ys` from its scanned slices."""
        return jax.tree.unflatten(self.tree, _merge(scanned_i, self.zero_slices, self.scanned_mask))


def _const_ct_types(rebuild, saved, free_, sunk_, consts_, ct_c, ct_ys) -> Any:
    """The cotangent types of the closed-over constants (layer 0's, as a template)."""
    first = lambda t: jax.tree.map(lambda x: x[0] if x.dtype != jax.dtypes.float0 else x, t)  # noqa: E731
    vjp_fn = rebuild(first(saved), first(free_), first(sunk_), consts_)
    return vjp_fn((ct_c, first(ct_ys)))[3]


@dataclasses.dataclass(
    frozen=True, eq=False
)  # eq=False: hashed by identity, as lax.scan hashes its body
class _BackwardStep:
    """One iteration of the backward scan: layer i's VJP, its sunk gradients added
    into the accumulators' slices, and (`above`) layer i+1's totals reduced.

    State: (d carry, d consts, bufs, accs). `bufs[k]`: the accumulator itself
    when entry k accumulates, else its result buffer (None when the results are
    kept in the accumulator, `holders[k]`). `accs[k]`: the running accumulator
    of an entry the last microbatch reduces, else None."""

    active: list
    residuals: _Residuals
    consts: Any
    cotangents: _LayerCotangents
    holders: list[bool]

    def __call__(self, state, xs, above=False):
        dc, dconsts, bufs, accs_ = state
        i, saved_i, free_i, sunk_i, scanned_i = xs
        vjp_fn = self.residuals.rebuild(saved_i, free_i, sunk_i, self.consts)
        dc, dfree, dsunk, dk = vjp_fn((dc, self.cotangents.of_layer(scanned_i)))
        dconsts = jax.tree.map(lambda a, b: a + b.astype(a.dtype), dconsts, dk)
        # Layer i+1's totals (`above`), finished in the previous iteration,
        # are reduced in this one: nothing of layer i's backward depends on
        # them, so an asynchronous collective can run under all of it. They
        # are read out of the accumulator here, not carried from the last
        # iteration (a carried copy would be live across the loop edge).
        n = len(self.active)
        above_totals = layer_totals(self.active, accs_, i + 1) if above else [None] * n
        reduced = reduce_layer(self.active, above_totals)
        new_bufs, new_accs = [], []
        for entry, buf, d, acc, total, holds in zip(
            self.active, bufs, dsunk, accs_, reduced, self.holders, strict=True
        ):
            buf, acc = _add_layer(entry, buf, acc, i, entry.prepare(d), total, holds)
            new_bufs.append(buf)
            new_accs.append(acc)
        return (dc, dconsts, new_bufs, new_accs), dfree


def _add_layer(entry: SinkLeaf, buf, acc, i, d, total, holds: bool) -> tuple:
    """(buf, acc) of one entry after layer i: `d` (prepared) added in place, and
    layer i+1's reduced `total` (None: none this iteration) kept."""
    if entry.final is None:
        return add_at(buf, i, d), None
    # Layer i+1's reduced gradient goes into its (now dead) slice of
    # the accumulator where it fits, else into the result buffer.
    if total is not None and holds:
        acc = store_result(acc, i + 1, total)
    elif total is not None:
        buf = set_at(buf, i + 1, total)
    # The layer's total is written into the running accumulator in
    # place, where the next iteration reads it. (Kept as a changing
    # carry: an unreduced loop invariant is all-reduced on loop entry.)
    return buf, add_at(acc, i, d)


def _backward(active: list[SinkLeaf], residuals: _Residuals, res: tuple, cts: tuple) -> tuple:
    """The custom_vjp backward: cotangents of (carry, free, sunk, consts, accs,
    sinks), the sinks' being the new accumulators (or the reduced gradients)."""
    saved, free_, sunk_, consts_, accs_ = res
    ct_c, ct_ys = cts
    count = jax.tree.leaves(sunk_)[0].shape[0]
    cotangents = _LayerCotangents.of(ct_ys)
    layer_cts = list(cotangents.scanned)
    dconst_types = jax.eval_shape(
        lambda: _const_ct_types(
            residuals.rebuild, saved, free_, sunk_, consts_, ct_c, cotangents.of_layer(layer_cts)
        )
    )
    zero_dk = jax.tree.map(zeros_like_type, dconst_types)
    # Where each layer's reduced gradient is kept until the pass ends: in the
    # accumulator's own dead layer slice where it fits (no stacked result
    # buffer beside the accumulator at the start of the backward, the
    # step's peak), else in a result buffer of the result's type.
    holders = [holds_result(acc, e.final) for e, acc in zip(active, accs_, strict=True)]
    bufs0 = [
        acc if e.final is None else (None if holds else zeros_like_type(e.sink))
        for e, acc, holds in zip(active, accs_, holders, strict=True)
    ]
    finals_in = [acc if e.final is not None else None for e, acc in zip(active, accs_, strict=True)]
    step = _BackwardStep(active, residuals, consts_, cotangents, holders)
    state0 = (ct_c, zero_dk, bufs0, finals_in)
    xs = (jnp.arange(count, dtype=jnp.int32), saved, free_, sunk_, cotangents.scanned)
    if all(e.final is None for e in active):
        (dc0, dconsts, bufs, _), dfree = lax.scan(step, state0, xs, reverse=True)
        return dc0, dfree, None, dconsts, None, bufs
    (dc0, dconsts, bufs, accs), dfree = _overlapped_backward(step, state0, xs, count)
    results = _final_results(active, bufs, accs, holders)
    return dc0, dfree, None, dconsts, None, results


def _overlapped_backward(step: _BackwardStep, state0: tuple, xs: tuple, count: int) -> tuple:
    """(state, dfree) of the last microbatch's backward, pipelined by one layer:
    the top layer's backward runs before the scan (it has no pending total to
    reduce), each scan iteration reduces the layer above it, and layer 0's
    total is reduced after the scan (`_final_results`), under whatever backward
    remains below the stack."""
    state, dfree_top = step(state0, jax.tree.map(lambda x: slice_at(x, count - 1), xs))
    dfree = jax.tree.map(stack_one, dfree_top)
    if count > 1:
        # The scan reads layers 0..count-2 out of the whole stacks by index,
        # with the helper the top layer's read uses. (Slicing the stacks to
        # count-1 layers first compiled to about the same memory on
        # deepseek3-small's v5e-8 overlap step, before the results moved into
        # the accumulator, commit d17ff92: no memory reason either way.)
        state, dfree_rest = lax.scan(
            lambda state_, i: step(state_, jax.tree.map(lambda x: slice_at(x, i), xs), above=True),
            state,
            jnp.arange(count - 1, dtype=jnp.int32),
            reverse=True,
        )
        dfree = jax.tree.map(concat, dfree_rest, dfree)
    return state, dfree


def _final_results(active: list[SinkLeaf], bufs: list, accs: list, holders: list) -> list:
    """Layer 0's totals reduced and every entry's stacked result read out: the
    reduced gradient of an entry the last microbatch reduces, else its new
    accumulator."""
    results = []
    totals = reduce_layer(active, layer_totals(active, accs, 0))
    for entry, buf, acc, total, holds in zip(active, bufs, accs, totals, holders, strict=True):
        if holds:
            acc = acc if total is None else store_result(acc, 0, total)
            results.append(read_results(acc, spec_of(entry.sink)))
        else:
            results.append(buf if total is None else set_at(buf, 0, total))
    return results
