"""Sharding operations that work the same in explicit and auto mode."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pspec_tags.specs import partitions, untagged
from pspec_tags.values import spec_of

MODES = ("explicit", "auto")


def shard(x: jax.Array, spec: P | None, mode: str) -> jax.Array:
    """Place `x` on `spec`: `jax.reshard` in explicit mode, a constraint in auto mode.

    Auto mode cannot carry `reduced`/`unreduced`, so the tags are stripped there;
    in explicit mode they are kept (resharding an unreduced value onto an
    untagged spec is exactly where its all-reduce happens).
    """
    if mode not in MODES:
        raise ValueError(f"shard mode {mode!r} is not one of {MODES}")
    if spec is None:
        return x
    if mode == "explicit":
        return jax.reshard(x, spec)
    return lax.with_sharding_constraint(x, untagged(spec))


def _out_sharding_like(like: jax.Array) -> NamedSharding | None:
    return jax.typeof(like).sharding if spec_of(like) is not None else None


def broadcast_param(param: jax.Array, like: jax.Array) -> jax.Array:
    """Broadcast a scale or bias over the trailing dims of `like`, in `like`'s sharding.

    `x + b` with `b` reduced over 'data' and `x` sharded over 'data' raises
    ShardingTypeError, and `jnp.broadcast_to(..., out_sharding=...)` iterates
    the tagged spec. `lax.broadcast_in_dim` with an explicit `out_sharding`
    does neither, and its transpose leaves the cotangent of a reduced `param`
    unreduced, so the gradient all-reduce stays deferred.
    """
    if param.ndim > like.ndim:
        raise ValueError(f"param of rank {param.ndim} cannot broadcast to rank {like.ndim}")
    dims = tuple(range(like.ndim - param.ndim, like.ndim))
    return lax.broadcast_in_dim(param, like.shape, dims, out_sharding=_out_sharding_like(like))


def embed_lookup(table: jax.Array, ids: jax.Array, out_spec: P | None = None) -> jax.Array:
    """Rows `table[ids]`, tag-safe: gradients of a reduced table stay unreduced.

    `table[ids]` trips JAX's "dangerous pspec" check on a tagged table;
    `.at[].get(out_sharding=...)` does not. By default the output follows the
    sharding of `ids` and keeps the table's embedding-dim partition when no
    mesh axis clashes.
    """
    ids_spec, table_spec = spec_of(ids), spec_of(table)
    if ids_spec is None or table_spec is None:
        return table.at[ids].get()
    if out_spec is None:
        lead = partitions(ids_spec) + (None,) * (ids.ndim - len(partitions(ids_spec)))
        table_parts = partitions(table_spec)
        last = table_parts[-1] if len(table_parts) == table.ndim else None
        used = {a for e in lead for a in ((e,) if isinstance(e, str) else (e or ()))}
        last_axes = (last,) if isinstance(last, str) else tuple(last or ())
        out_spec = P(*lead, None if used & set(last_axes) else last)
    mesh = jax.typeof(table).sharding.mesh
    return table.at[ids].get(out_sharding=NamedSharding(mesh, untagged(out_spec)))
