"""The step's last microbatch under an overlapped schedule (accum.schedule): each
layer's total reduced inside the backward layer scan of `accum.scan_layers`, one
layer behind its backward.

`reduce_layer` groups one layer's totals into as few collectives as the targets
allow (one all-reduce bucket per dtype and axes, one ring per dtype and ring
axes, the other reduce-scatters one by one), all under `OVERLAPPED_SCOPE`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from accum.layer_slices import slice_at
from accum.ring import ring_dim, ring_reduce_scatter, ring_size
from accum.sink_leaf import SinkLeaf
from pspec_tags import partitions, spec_of, unreduced_axes, untagged

# The name scope of the last microbatch's per-layer reductions: hlo_tools reads it
# (hlo_tools.OVERLAPPED_SCOPE, the same string) to tell each gradient's one
# reduction, issued layer by layer, from a reduction repeated per microbatch.
OVERLAPPED_SCOPE = "overlapped_gradient_reduction"


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


def reduce_layer(entries: list[SinkLeaf], totals: list) -> list:
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
        key = _ring_key(entry, total)
        if key is not None:
            rings.setdefault(key, []).append(k)
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


def layer_totals(entries: list[SinkLeaf], accs: list, i: jax.Array | int) -> list:
    """Layer i of each accumulator the last microbatch reduces (None for the others)."""
    return [
        None if entry.final is None else slice_at(acc, i)
        for entry, acc in zip(entries, accs, strict=True)
    ]
