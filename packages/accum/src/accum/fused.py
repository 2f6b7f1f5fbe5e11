"""Gradient accumulation fused into the backward pass of a scanned layer stack.

`scan_layers(body, carry, stacked)` is `lax.scan` over a stack of layers. Inside
`accumulate_gradients(..., fused=True)` (or `add(..., fused=True)`), each
stacked parameter's gradient is added into its accumulator's slice *inside* the
backward layer scan, as each layer's gradient is produced: no full-size
per-microbatch gradient exists beside the accumulator (Megatron's
gradient-accumulation fusion). On the step's last microbatch (`overlap`), each
layer's final sum is reduced there instead — all-reduce, or reduce-scatter onto
ZeRO-1 shards — pipelined by one layer: iteration l reduces layer l+1's total
(finished in the previous iteration) while it computes layer l's backward, so
nothing in the iteration waits for that collective and it can run under all of it.

How: the stack is a `custom_vjp` whose forward is the plain scan (saving each
layer's VJP residuals) and whose backward is a reverse scan that carries the
accumulator and updates it in place. The new accumulator leaves the backward
pass as the cotangent of a *sink*: a dummy zero input whose cotangent type is
the accumulator's (a `reduced` sink for an `unreduced` accumulator, since
autodiff maps reduced primals to unreduced cotangents). A *probe* on each
parameter sees, with symbolic zeros, whether the parameter also reached the
loss outside `scan_layers` (weight decay, tied weights), so that gradient is
added the ordinary way instead of being lost.

Outside an accumulation context `scan_layers` is exactly `lax.scan`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum.ring import ring_dim, ring_reduce_scatter, ring_size
from accum.seed import value_and_grad as seeded_value_and_grad
from pspec_tags import (
    check_unreduced,
    partitions,
    reduced_axes,
    spec_of,
    unreduced_axes,
    untagged,
)

_STATE = threading.local()

# The name scope of the last microbatch's per-layer reductions: hlo_tools reads it
# (hlo_tools.OVERLAPPED_SCOPE, the same string) to tell each gradient's one
# reduction, issued layer by layer, from a reduction repeated per microbatch.
OVERLAPPED_SCOPE = "overlapped_gradient_reduction"


def _floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def without_leading(spec: P | None) -> P | None:
    """`spec` of one layer's slice: the leading (layer) entry dropped, tags kept."""
    if spec is None:
        return None
    # TAG: rebuilt from partitions + both tag sets; spec[1:] would drop them.
    return P(*partitions(spec)[1:], unreduced=unreduced_axes(spec), reduced=reduced_axes(spec))


@dataclasses.dataclass
class SinkLeaf:
    """One parameter leaf's fused accumulation (built by accum, read by `scan_layers`).

    `acc`: the running accumulator (stacked like the parameter). `final`: None to
    accumulate into `acc`; else the slice-level target (PartitionSpec) the last
    microbatch reduces each layer's total onto. `prepare(d_slice)`: a layer's
    gradient made addable to an accumulator slice (checked, scattered, cast).
    `place(total_slice, target)`: the reduction. `sink`: the dummy primal whose
    cotangent returns the result. `ring`: a reduce-scatter onto `final` goes as a
    ring of collective-permutes (accum.ring) instead of one reduce-scatter.
    `claimed`/`used_elsewhere` are set at trace time.
    """

    acc: jax.Array
    final: Any
    prepare: Callable[[jax.Array], jax.Array]
    place: Callable[[jax.Array, Any], jax.Array]
    sink: Any = None
    ring: bool = False
    claimed: bool = False
    used_elsewhere: bool = False


@contextlib.contextmanager
def sinks_active(by_id: dict[int, SinkLeaf]):
    """Within this context, `scan_layers` fuses the leaves whose `id` is in `by_id`."""
    stack = getattr(_STATE, "stack", [])
    _STATE.stack = [*stack, by_id]
    try:
        yield
    finally:
        _STATE.stack = stack


def _active() -> dict[int, SinkLeaf] | None:
    stack = getattr(_STATE, "stack", [])
    return stack[-1] if stack else None


def _leading_unsharded(x: jax.Array) -> bool:
    parts = partitions(spec_of(x))
    return not parts or parts[0] is None


def scan_layers(body: Callable, carry: Any, stacked: Any) -> tuple[Any, Any]:
    """`lax.scan(body, carry, stacked)` over a layer stack, fused with gradient accumulation.

    `body(carry, layer) -> (carry, y)`; `stacked` holds the layers' parameters on
    a leading axis. Outside `accumulate_gradients(..., fused=True)` this is
    `lax.scan`. Inside, every stacked parameter leaf accum accumulates (and
    whose layer axis is not sharded) has its gradient added into its
    accumulator slice inside the backward scan. `body` may close over other
    values (positions, masks, shared weights): their gradients flow as usual.

    >>> import jax, jax.numpy as jnp
    >>> from accum import scan_layers
    >>> w_LxDxD = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> x_D, ys = scan_layers(lambda x, w: (x @ w, x.sum()), jnp.ones(2), w_LxDxD)
    >>> x_D.tolist(), ys.tolist()
    ([2.0, 2.0], [2.0, 2.0])
    """
    by_id = _active()
    leaves, tree = jax.tree.flatten(stacked)
    entries = [None] * len(leaves)
    if by_id is not None:
        for k, leaf in enumerate(leaves):
            entry = by_id.get(id(leaf))
            # A second use of the same stack is an ordinary use (its gradient
            # reaches the probe and is added by accum); a sharded layer axis
            # cannot be sliced in place.
            if entry is not None and not entry.claimed and _leading_unsharded(leaf):
                entry.claimed = True
                entries[k] = entry
    if not any(entries):
        return lax.scan(body, carry, stacked)
    return _fused_scan(body, carry, leaves, tree, entries)


def _split(items: list, mask: list[bool]) -> tuple[list, list]:
    return [x for x, m in zip(items, mask, strict=True) if m], [
        x for x, m in zip(items, mask, strict=True) if not m
    ]


def _merge(yes: list, no: list, mask: list[bool]) -> list:
    yes_it, no_it = iter(yes), iter(no)
    return [next(yes_it) if m else next(no_it) for m in mask]


def _zeros_like_type(x: Any) -> jax.Array:
    """Zeros with `x`'s shape, dtype and sharding type (tags included)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and spec_of(x) is not None:
        return lax.broadcast_in_dim(jnp.zeros((), x.dtype), x.shape, (), out_sharding=sharding)
    return jnp.zeros(x.shape, x.dtype)


def _local(fn: Callable, out_spec: P | None, *args: jax.Array) -> jax.Array:
    """`fn(*args)` on each device's blocks when an argument is unreduced.

    JAX has no unreduced rule for dynamic_slice; per device the partial sums are
    plain arrays, and slicing or updating them along the unsharded layer axis
    is local. `check_vma=False`: the blocks are read as plain local arrays.
    """
    specs = [spec_of(a) for a in args]
    if not any(unreduced_axes(s) for s in specs if s is not None):
        return fn(*args)
    mesh = jax.typeof(args[0]).sharding.mesh
    # TAG: in/out specs are the values' own, unreduced tags included, so the
    # result is typed as the same per-device partial sums.
    in_specs = tuple(s if s is not None else P() for s in specs)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
        *args
    )


def _slice_at(acc: jax.Array, i: jax.Array) -> jax.Array:
    index = jnp.asarray(i, jnp.int32)
    return _local(
        lambda a, j: lax.dynamic_index_in_dim(a, j, keepdims=False),
        without_leading(spec_of(acc)),
        acc,
        index,
    )


def _add_at(acc: jax.Array, i: jax.Array, d: jax.Array) -> jax.Array:
    """acc with acc[i] += d, in place (the carry of the backward scan)."""

    def add(a, j, u):
        current = lax.dynamic_index_in_dim(a, j, keepdims=False)
        return lax.dynamic_update_index_in_dim(a, current + u.astype(a.dtype), j, 0)

    return _local(add, spec_of(acc), acc, jnp.asarray(i, jnp.int32), d)


def _set_at(out: jax.Array, i: jax.Array, d: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(out, d.astype(out.dtype), jnp.asarray(i, jnp.int32), 0)


def _reduce(entry: SinkLeaf, total: jax.Array) -> jax.Array:
    """One layer's final total reduced onto its slice target (the step's one
    reduction of that layer), under the scope hlo_tools recognises."""
    with jax.named_scope(OVERLAPPED_SCOPE):
        # XLA names a reduction after its operand's op. `total` is a loop carry
        # (last iteration's slice), whose op carries the loop's name: a barrier
        # inside the scope gives the reduction an operand op that carries the
        # scope (and costs nothing: the carry is already computed).
        return entry.place(lax.optimization_barrier(total), entry.final)


def _bucket_axes(entry: SinkLeaf, total: jax.Array) -> frozenset | None:
    """The axes a plain all-reduce of `total` onto `entry.final` runs over; None
    when the reduction is anything else (a reduce-scatter onto ZeRO-1 shards, a
    value that is not unreduced, auto mode)."""
    spec = spec_of(total)
    if spec is None or not unreduced_axes(spec) or entry.final is None:
        return None
    pad = lambda parts: tuple(parts) + (None,) * (total.ndim - len(parts))  # noqa: E731
    if pad(partitions(entry.final)) != pad(partitions(spec)):
        return None
    return unreduced_axes(spec)


def _reduce_bucket(totals: list[jax.Array], axes: frozenset) -> list[jax.Array]:
    """All-reduce several layer totals as one flat buffer (DDP's bucket).

    XLA:TPU makes a single-array all-reduce asynchronous but not a combined
    (tuple) one, and its combiner would merge a layer's many small reductions
    into one: flattening them into one array gives one collective per layer that
    can run under the next layer's backward. Per device the totals are plain
    partial sums, so raveling, joining and splitting them is local.
    """
    mesh = jax.typeof(totals[0]).sharding.mesh
    names = tuple(a for a in mesh.axis_names if a in axes)
    specs = tuple(spec_of(t) for t in totals)

    def body(*blocks):
        flat = lax.psum(jnp.concatenate([b.reshape(-1) for b in blocks]), names)
        out, start = [], 0
        for b in blocks:
            out.append(flat[start : start + b.size].reshape(b.shape))
            start += b.size
        return tuple(out)

    # TAG: in_specs are the totals' own (unreduced over `axes`); out_specs the
    # same partitions untagged: the psum is the reduction, typed as its result.
    with jax.named_scope(OVERLAPPED_SCOPE):
        return list(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=specs,
                out_specs=tuple(untagged(sp) for sp in specs),
                check_vma=False,
            )(*totals)
        )


def _ring_key(entry: SinkLeaf, total: jax.Array) -> tuple | None:
    """`ring_key(total, entry.final)` when the entry reduces by a ring; else None."""
    if not entry.ring or entry.final is None:
        return None
    return ring_key(total, entry.final)


def ring_key(total: jax.Array, final: P) -> tuple | None:
    """(dtype, ring axes, psummed axes) bucket key when reducing `total` onto
    `final` can go as a ring (accum.ring); None otherwise."""
    own = spec_of(total)
    found = ring_dim(own, final)
    if found is None:
        return None
    dim, axes = found
    # ring_dim's dim is unsharded in `own`: the local block holds all of it.
    if total.shape[dim] % ring_size(jax.typeof(total).sharding.mesh, axes):
        return None  # the shard would not be whole: the plain reduce-scatter says why
    rest = frozenset(unreduced_axes(own)) - set(axes)
    return (total.dtype, axes, rest)


def ring_place(totals: list[jax.Array], finals: list[P]) -> list[jax.Array]:
    """`totals` reduced onto `finals` by one ring, under the overlapped scope
    (every pair must have one `ring_key`)."""
    owns = [spec_of(t) for t in totals]
    dims = [ring_dim(o, f)[0] for o, f in zip(owns, finals, strict=True)]
    with jax.named_scope(OVERLAPPED_SCOPE):
        # Same barrier as `_reduce`: the permutes' operand ops carry the scope.
        totals = [lax.optimization_barrier(t) for t in totals]
        return ring_reduce_scatter(totals, owns, list(finals), dims)


def _reduce_layer(entries: list[SinkLeaf], totals: list) -> list:
    """Each layer total (None: nothing to reduce) reduced onto its entry's target:
    plain all-reduces of one dtype over the same axes as one bucket, ring
    reduce-scatters (`SinkLeaf.ring`) of one dtype and axes as one ring, the rest
    (reduce-scatters onto ZeRO-1 shards) one by one."""
    out: list = [None] * len(totals)
    buckets: dict = {}
    rings: dict = {}
    for k, (entry, total) in enumerate(zip(entries, totals, strict=True)):
        if total is None:
            continue
        ring_key = _ring_key(entry, total)
        if ring_key is not None:
            rings.setdefault(ring_key, []).append(k)
            continue
        axes = _bucket_axes(entry, total)
        if axes is None:
            out[k] = _reduce(entry, total)
        else:
            buckets.setdefault((total.dtype, axes), []).append(k)
    for (_, axes), ks in buckets.items():
        if len(ks) == 1:
            out[ks[0]] = _reduce(entries[ks[0]], totals[ks[0]])
            continue
        for k, reduced in zip(ks, _reduce_bucket([totals[k] for k in ks], axes), strict=True):
            out[k] = reduced
    for ks in rings.values():
        reduced = ring_place([totals[k] for k in ks], [entries[k].final for k in ks])
        for k, r in zip(ks, reduced, strict=True):
            out[k] = r
    return out


def _holds_result(entry: SinkLeaf, acc: jax.Array) -> bool:
    """Whether the last microbatch can keep each layer's reduced gradient in the
    accumulator's own slice of that layer (dead once reduced) instead of a
    separate stacked result buffer: an unreduced accumulator whose per-device
    block of a layer holds the result's block (ZeRO-1's shard, or the whole
    layer for an all-reduce)."""
    own = spec_of(acc)
    if entry.final is None or own is None or not unreduced_axes(own):
        return False
    mesh = jax.typeof(acc).sharding.mesh
    layer = acc.shape[1:]
    acc_block = NamedSharding(mesh, untagged(without_leading(own))).shard_shape(layer)
    result_block = NamedSharding(mesh, untagged(entry.final)).shard_shape(layer)
    return all(r <= a for r, a in zip(result_block, acc_block, strict=True))


def _store_result(acc: jax.Array, i: jax.Array, result: jax.Array) -> jax.Array:
    """acc with layer i's reduced `result` written, per device, at the start of
    that layer's block (the layer's partial sums are no longer needed).

    Per device the accumulator is a plain array of partial sums and the result
    a block of the reduced gradient: the write is local. No reshape of the
    accumulator (on TPU a reshape of a tiled array can be a copy of all of it).
    """

    def store(a, j, r):
        starts = (j,) + (0,) * r.ndim
        return lax.dynamic_update_slice(a, r[None].astype(a.dtype), starts)

    # TAG: the accumulator keeps its own spec (unreduced): only the bytes of a
    # dead layer slice change; the result enters as its own (reduced) blocks.
    return _local(store, spec_of(acc), acc, jnp.asarray(i, jnp.int32), result)


def _read_results(acc: jax.Array, stacked_final: P) -> jax.Array:
    """The reduced gradients `_store_result` left in `acc`, as one stacked array on
    `stacked_final` (each device's block: the leading corner of its layer blocks)."""
    mesh = jax.typeof(acc).sharding.mesh
    block = NamedSharding(mesh, stacked_final).shard_shape(acc.shape)

    def read(a):
        return lax.slice(a, (0,) * a.ndim, block)

    # TAG: out spec is the result's stacked spec (untagged: reduced); each
    # device's corner block is its block of the reduced gradient by construction.
    return _local(read, stacked_final, acc)


def _layer_totals(entries: list[SinkLeaf], accs: list, i: jax.Array | int) -> list:
    """Layer i of each accumulator the last microbatch reduces (None for the others)."""
    return [
        None if entry.final is None else _slice_at(acc, i)
        for entry, acc in zip(entries, accs, strict=True)
    ]


def _stack_one(x: jax.Array) -> jax.Array:
    """`x[None]`: one layer's value as a stack of one, per device where unreduced."""
    spec = spec_of(x)
    # TAG: the new leading (layer) entry is unsharded; both tag sets carried over.
    stacked = (
        None
        if spec is None
        else P(None, *partitions(spec), unreduced=unreduced_axes(spec), reduced=reduced_axes(spec))
    )
    return _local(lambda a: a[None], stacked, x)


def _concat(head: jax.Array, tail: jax.Array) -> jax.Array:
    """`head` and `tail` joined along the layer axis, per device where unreduced."""
    return _local(lambda a, b: jnp.concatenate([a, b]), spec_of(head), head, tail)


def _fused_scan(body, carry, leaves, tree, entries):
    sunk_mask = [e is not None for e in entries]
    float_mask = [_floating(x) for x in leaves]
    sunk, rest = _split(leaves, sunk_mask)
    rest_entries_mask = [f for f, s in zip(float_mask, sunk_mask, strict=True) if not s]
    free, fixed = _split(rest, rest_entries_mask)  # differentiable / integer stacked leaves
    active = [e for e in entries if e is not None]

    def layer_input(free_i, sunk_i, fixed_i):
        return jax.tree.unflatten(
            tree, _merge(sunk_i, _merge(free_i, fixed_i, rest_entries_mask), sunk_mask)
        )

    # Values `body` closes over become explicit inputs, so their cotangents
    # (shared weights, for instance) are summed over layers here.
    example = layer_input([x[0] for x in free], [x[0] for x in sunk], [x[0] for x in fixed])
    closed_body, consts = jax.closure_convert(body, carry, example)

    def layer(c, free_i, sunk_i, consts_, fixed_i):
        return closed_body(c, layer_input(free_i, sunk_i, fixed_i), *consts_)

    residual_plan: dict = {}

    def forward(c, xs_i, consts_):
        free_i, sunk_i, fixed_i = xs_i
        out, vjp_fn = jax.vjp(
            lambda c_, f_, s_, k_: layer(c_, f_, s_, k_, fixed_i), c, free_i, sunk_i, consts_
        )
        res, res_tree = jax.tree.flatten(vjp_fn)
        # Residuals that are this layer's own inputs are read from the stack
        # (or the constants) in the backward scan instead of being saved twice.
        sources = {id(x): ("free", k) for k, x in enumerate(free_i)}
        sources.update({id(x): ("sunk", k) for k, x in enumerate(sunk_i)})
        sources.update({id(x): ("const", k) for k, x in enumerate(jax.tree.leaves(consts_))})
        where = [sources.get(id(r), ("saved", None)) for r in res]
        residual_plan["tree"], residual_plan["where"] = res_tree, where
        saved = [r for r, w in zip(res, where, strict=True) if w[0] == "saved"]
        new_c, y = out
        return new_c, (y, saved)

    def rebuild(saved_i, free_i, sunk_i, consts_):
        saved_it = iter(saved_i)
        pools = {"free": free_i, "sunk": sunk_i, "const": jax.tree.leaves(consts_)}
        res = [
            next(saved_it) if w[0] == "saved" else pools[w[0]][w[1]] for w in residual_plan["where"]
        ]
        return jax.tree.unflatten(residual_plan["tree"], res)

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
        saved, free_, sunk_, consts_, accs_ = res
        ct_c, ct_ys = cts
        count = jax.tree.leaves(sunk_)[0].shape[0]
        # Integer outputs (counts) have float0 cotangents: rebuilt per layer, not scanned.
        ct_leaves, ct_tree = jax.tree.flatten(ct_ys)
        is_zero = [x.dtype == jax.dtypes.float0 for x in ct_leaves]
        scanned_cts, zero_cts = _split(ct_leaves, [not z for z in is_zero])
        # float0 cotangents are host arrays: one layer's is a slice of them.
        zero_slices = [x[0] for x in zero_cts]

        def ct_y_of(scanned_i):
            return jax.tree.unflatten(
                ct_tree, _merge(scanned_i, zero_slices, [not z for z in is_zero])
            )

        def step(state, xs, above=False):
            dc, dconsts, bufs, accs_ = state
            i, saved_i, free_i, sunk_i, scanned_i = xs
            vjp_fn = rebuild(saved_i, free_i, sunk_i, consts_)
            dc, dfree, dsunk, dk = vjp_fn((dc, ct_y_of(scanned_i)))
            dconsts = jax.tree.map(lambda a, b: a + b.astype(a.dtype), dconsts, dk)
            # Layer i+1's totals (`above`), finished in the previous iteration,
            # are reduced in this one: nothing of layer i's backward depends on
            # them, so an asynchronous collective can run under all of it. They
            # are read out of the accumulator here, not carried from the last
            # iteration (a carried copy would be live across the loop edge).
            above_totals = _layer_totals(active, accs_, i + 1) if above else [None] * len(active)
            reduced = _reduce_layer(active, above_totals)
            new_bufs, new_accs = [], []
            for entry, buf, d, acc, total, holds in zip(
                active, bufs, dsunk, accs_, reduced, holders, strict=True
            ):
                d = entry.prepare(d)
                if entry.final is None:
                    new_bufs.append(_add_at(buf, i, d))
                    new_accs.append(None)
                    continue
                # Layer i+1's reduced gradient goes into its (now dead) slice of
                # the accumulator where it fits, else into the result buffer.
                if total is not None and holds:
                    acc = _store_result(acc, i + 1, total)
                elif total is not None:
                    buf = _set_at(buf, i + 1, total)
                # The layer's total is written into the running accumulator in
                # place, where the next iteration reads it. (Kept as a changing
                # carry: an unreduced loop invariant is all-reduced on loop entry.)
                new_bufs.append(buf)
                new_accs.append(_add_at(acc, i, d))
            return (dc, dconsts, new_bufs, new_accs), dfree

        zero_dk = jax.tree.map(
            _zeros_like_type,
            jax.eval_shape(
                lambda: step_ct_types(
                    rebuild, saved, free_, sunk_, consts_, ct_c, ct_y_of([x for x in scanned_cts])
                )
            ),
        )
        # Where each layer's reduced gradient is kept until the pass ends: in the
        # accumulator's own dead layer slice where it fits (no stacked result
        # buffer beside the accumulator at the start of the backward, the
        # step's peak), else in a result buffer of the result's type.
        holders = [_holds_result(e, acc) for e, acc in zip(active, accs_, strict=True)]
        bufs0 = [
            acc if e.final is None else (None if holds else _zeros_like_type(e.sink))
            for e, acc, holds in zip(active, accs_, holders, strict=True)
        ]
        finals_in = [
            acc if e.final is not None else None for e, acc in zip(active, accs_, strict=True)
        ]
        state0 = (ct_c, zero_dk, bufs0, finals_in)
        xs = (jnp.arange(count, dtype=jnp.int32), saved, free_, sunk_, scanned_cts)
        if all(e.final is None for e in active):
            (dc0, dconsts, bufs, _), dfree = lax.scan(step, state0, xs, reverse=True)
            return dc0, dfree, None, dconsts, None, bufs
        # The last microbatch, pipelined by one layer: the top layer's backward
        # runs before the scan (it has no pending total to reduce), each scan
        # iteration reduces the layer above it, and layer 0's total is reduced
        # after the scan, under whatever backward remains below the stack.
        state, dfree_top = step(state0, jax.tree.map(lambda x: _slice_at(x, count - 1), xs))
        dfree = jax.tree.map(_stack_one, dfree_top)
        if count > 1:
            # The scan reads layers 0..count-2 out of the whole stacks by index,
            # with the helper the top layer's read uses. (Slicing the stacks to
            # count-1 layers first compiled to 6.94 GiB where this read 7.00 on
            # deepseek3-small's v5e-8 overlap step, before the results moved into
            # the accumulator: no memory reason either way.)
            state, dfree_rest = lax.scan(
                lambda state_, i: step(
                    state_, jax.tree.map(lambda x: _slice_at(x, i), xs), above=True
                ),
                state,
                jnp.arange(count - 1, dtype=jnp.int32),
                reverse=True,
            )
            dfree = jax.tree.map(_concat, dfree_rest, dfree)
        dc0, dconsts, bufs, accs = state
        results = []
        totals = _reduce_layer(active, _layer_totals(active, accs, 0))
        for entry, buf, acc, total, holds in zip(active, bufs, accs, totals, holders, strict=True):
            if holds:
                acc = acc if total is None else _store_result(acc, 0, total)
                results.append(_read_results(acc, spec_of(entry.sink)))
            else:
                results.append(buf if total is None else _set_at(buf, 0, total))
        return dc0, dfree, None, dconsts, None, results

    stack.defvjp(stack_fwd, stack_bwd)
    sinks = [e.sink for e in active]
    # The accumulators enter as inputs (residuals of the backward), not as closures.
    return stack(carry, free, sunk, consts, [e.acc for e in active], sinks)


def step_ct_types(rebuild, saved, free_, sunk_, consts_, ct_c, ct_ys):
    """The cotangent types of the closed-over constants (layer 0's, as a template)."""
    first = lambda t: jax.tree.map(lambda x: x[0] if x.dtype != jax.dtypes.float0 else x, t)  # noqa: E731
    vjp_fn = rebuild(first(saved), first(free_), first(sunk_), consts_)
    return vjp_fn((ct_c, first(ct_ys)))[3]


def check_layer_grad(d: jax.Array, axes: tuple[str, ...]) -> None:
    """A layer's gradient must be unreduced over `axes` (its leaf's tagged axes)."""
    if axes:
        check_unreduced(d, axes)


def _probe(x: jax.Array, entry: SinkLeaf) -> jax.Array:
    """Identity whose backward notes (at trace time) whether `x`'s gradient is
    nonzero: a use of the parameter outside `scan_layers`."""

    @jax.custom_vjp
    def probe(value):
        return value

    def probe_fwd(value):
        return value.value, None

    def probe_bwd(_, ct):
        if isinstance(ct, jax.custom_derivatives.SymbolicZero):
            return (None,)
        entry.used_elsewhere = True
        return (ct,)

    probe.defvjp(probe_fwd, probe_bwd, symbolic_zeros=True)
    return probe(x)


def sink_type(acc: jax.Array, final_spec: P | None) -> Any:
    """Zeros whose cotangent type is the result's: `final_spec` (untagged) when
    reducing, else the accumulator's own type, via a `reduced` tag where it is
    `unreduced` (autodiff pairs the two)."""
    spec = spec_of(acc)
    if final_spec is not None:
        target = final_spec
    elif spec is None:
        return jnp.zeros(acc.shape, acc.dtype)
    else:
        # TAG: reduced over exactly the accumulator's unreduced axes, so the
        # sink's cotangent is typed like the accumulator (no reshard on return).
        target = P(*partitions(spec), reduced=unreduced_axes(spec))
    mesh = jax.typeof(acc).sharding.mesh
    return lax.broadcast_in_dim(
        jnp.zeros((), acc.dtype), acc.shape, (), out_sharding=NamedSharding(mesh, target)
    )


def fused_value_and_grad(
    loss_fn: Callable,
    params: Any,
    args: tuple,
    entry_leaves: list,
) -> tuple[tuple[jax.Array, dict], Any, list]:
    """`((loss_sum, aux), grads, sink_results)` with `entry_leaves` (a SinkLeaf or
    None per parameter leaf, flattened) offered to `scan_layers` inside `loss_fn`.

    For a claimed leaf, `sink_results` holds the new accumulator (or the reduced
    gradient) and `grads` its gradient from other uses (valid only when the
    entry's `used_elsewhere` is set); other leaves' `grads` are as usual.
    """
    treedef = jax.tree.structure(params)
    param_leaves = treedef.flatten_up_to(params)
    sinks = [None if e is None else e.sink for e in entry_leaves]

    def loss_with_sinks(param_leaves_, sinks_):
        by_id = {}
        probed = []
        for p, e, s in zip(param_leaves_, entry_leaves, sinks_, strict=True):
            if e is not None:
                p = _probe(p, e)
                e.sink = s
                by_id[id(p)] = e
            probed.append(p)
        with sinks_active(by_id):
            return loss_fn(jax.tree.unflatten(treedef, probed), *args)

    (loss_sum, aux), (grad_leaves, sink_cts) = seeded_value_and_grad(
        loss_with_sinks, argnums=(0, 1)
    )(param_leaves, sinks)
    for e, s in zip(entry_leaves, sinks, strict=True):
        if e is not None:
            e.sink = s
    return (loss_sum, aux), jax.tree.unflatten(treedef, grad_leaves), sink_cts
