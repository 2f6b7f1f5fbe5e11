"""One layer's slice of a stacked array (layer axis leading), read and written in place.

The backward layer scan of `accum.scan_layers` reads and updates accumulators
layer by layer. An accumulator is often `unreduced` (per-device partial sums),
and JAX has no unreduced rule for dynamic_slice: these helpers do the slicing
per device (`_local`), where the partial sums are plain arrays and the layer
axis, unsharded, is local.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pspec_tags import partitions, reduced_axes, spec_of, unreduced_axes, untagged


def without_leading(spec: P | None) -> P | None:
    """`spec` of one layer's slice: the leading (layer) entry dropped, tags kept."""
    if spec is None:
        return None
    # TAG: rebuilt from partitions + both tag sets; spec[1:] would drop them.
    return P(*partitions(spec)[1:], unreduced=unreduced_axes(spec), reduced=reduced_axes(spec))


def leading_unsharded(spec: P | None) -> bool:
    """Whether `spec`'s leading (layer) axis is unsharded, so one layer's slice is
    local to every device (None, and a spec with no entries, count as unsharded)."""
    parts = partitions(spec)
    return not parts or parts[0] is None


def zeros_like_type(x: Any) -> jax.Array:
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


def slice_at(acc: jax.Array, i: jax.Array | int) -> jax.Array:
    """`acc[i]`: layer i's slice (typed like `acc`, tags included)."""
    index = jnp.asarray(i, jnp.int32)
    return _local(
        lambda a, j: lax.dynamic_index_in_dim(a, j, keepdims=False),
        without_leading(spec_of(acc)),
        acc,
        index,
    )


def add_at(acc: jax.Array, i: jax.Array, d: jax.Array) -> jax.Array:
    """acc with acc[i] += d, in place (the carry of the backward scan)."""

    def add(a, j, u):
        current = lax.dynamic_index_in_dim(a, j, keepdims=False)
        return lax.dynamic_update_index_in_dim(a, current + u.astype(a.dtype), j, 0)

    return _local(add, spec_of(acc), acc, jnp.asarray(i, jnp.int32), d)


def set_at(out: jax.Array, i: jax.Array | int, d: jax.Array) -> jax.Array:
    """out with out[i] = d (cast to `out`'s dtype)."""
    return lax.dynamic_update_index_in_dim(out, d.astype(out.dtype), jnp.asarray(i, jnp.int32), 0)


def stack_one(x: jax.Array) -> jax.Array:
    """`x[None]`: one layer's value as a stack of one, per device where unreduced."""
    spec = spec_of(x)
    # TAG: the new leading (layer) entry is unsharded; both tag sets carried over.
    stacked = (
        None
        if spec is None
        else P(None, *partitions(spec), unreduced=unreduced_axes(spec), reduced=reduced_axes(spec))
    )
    return _local(lambda a: a[None], stacked, x)


def concat(head: jax.Array, tail: jax.Array) -> jax.Array:
    """`head` and `tail` joined along the layer axis, per device where unreduced."""
    return _local(lambda a, b: jnp.concatenate([a, b]), spec_of(head), head, tail)


def holds_result(acc: jax.Array, final: P | None) -> bool:
    """Whether the last microbatch can keep each layer's gradient reduced onto
    `final` in the accumulator's own slice of that layer (dead once reduced)
    instead of a separate stacked result buffer: an unreduced accumulator whose
    per-device block of a layer holds the result's block (ZeRO-1's shard, or the
    whole layer for an all-reduce)."""
    own = spec_of(acc)
    if final is None or own is None or not unreduced_axes(own):
        return False
    mesh = jax.typeof(acc).sharding.mesh
    layer = acc.shape[1:]
    acc_block = NamedSharding(mesh, untagged(without_leading(own))).shard_shape(layer)
    result_block = NamedSharding(mesh, untagged(final)).shard_shape(layer)
    return all(r <= a for r, a in zip(result_block, acc_block, strict=True))


def store_result(acc: jax.Array, i: jax.Array | int, result: jax.Array) -> jax.Array:
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


def read_results(acc: jax.Array, stacked_final: P) -> jax.Array:
    """The reduced gradients `store_result` left in `acc`, as one stacked array on
    `stacked_final` (each device's block: the leading corner of its layer blocks)."""
    mesh = jax.typeof(acc).sharding.mesh
    block = NamedSharding(mesh, stacked_final).shard_shape(acc.shape)

    def read(a):
        return lax.slice(a, (0,) * a.ndim, block)

    # TAG: out spec is the result's stacked spec (untagged: reduced); each
    # device's corner block is its block of the reduced gradient by construction.
    return _local(read, stacked_final, acc)
