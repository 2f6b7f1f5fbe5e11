"""Sharding operations that work the same in explicit and auto mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pspec_tags.specs import mesh_axes_used, partitions, unreduced_axes, untagged, with_unreduced
from pspec_tags.values import spec_of

MODES = ("explicit", "auto")


def shard(x: jax.Array, spec: P | None, mode: str) -> jax.Array:
    """Place `x` on `spec`: `jax.reshard` in explicit mode, a constraint in auto mode.

    Auto mode cannot carry `reduced`/`unreduced`, so the tags are stripped there;
    in explicit mode they are kept (resharding an unreduced value onto an
    untagged spec is exactly where its all-reduce happens).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> x_BxD = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> with jax.set_mesh(mesh):
    ...     jax.typeof(pt.shard(x_BxD, P(None, None), "explicit")).sharding.spec
    P(None, None)
    """
    if mode not in MODES:
        raise ValueError(f"shard mode {mode!r} is not one of {MODES}")
    if spec is None:
        return x
    if mode == "explicit":
        if spec_of(x) == spec:
            # Already there: skip the reshard. Not only tidier: a reshard is a
            # new value, and one feeding a shard_map inside a scanned layer is
            # saved as a residual for the backward pass (a stacked copy of the
            # weights it carries), where the original would just be re-sliced.
            return x
        # TAG: the spec as given, tags kept: onto an untagged spec an unreduced x is
        # reduced right here.
        return jax.reshard(x, spec)
    # TAG: auto mode cannot carry tags: stripped.
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

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> x_BxD = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> w_D = jax.device_put(jnp.ones(4), NamedSharding(mesh, P(None, reduced={"data"})))
    >>> with jax.set_mesh(mesh):
    ...     jax.typeof(pt.broadcast_param(w_D, x_BxD))  # w_D + x_BxD would raise
    ShapedArray(float32[8@data,4])
    """
    if param.ndim > like.ndim:
        raise ValueError(f"param of rank {param.ndim} cannot broadcast to rank {like.ndim}")
    dims = tuple(range(like.ndim - param.ndim, like.ndim))
    # TAG: in `like`'s sharding, so the op with `like` is elementwise and a reduced
    # param's cotangent stays a local (unreduced) sum.
    return lax.broadcast_in_dim(param, like.shape, dims, out_sharding=_out_sharding_like(like))


def embed_lookup(table: jax.Array, ids: jax.Array, out_spec: P | None = None) -> jax.Array:
    """Rows `table[ids]`, tag-safe: gradients of a reduced table stay unreduced.

    `table[ids]` trips JAX's "dangerous pspec" check on a tagged table.
    `.at[ids].get(out_sharding=...)` works but, on JAX 0.10.2, reshards the
    table to an untagged spec and all-gathers `ids` (and, in the backward, the
    activation cotangents) onto every device each microbatch; its transpose
    still gives the table an unreduced cotangent, so no gradient is reduced in
    the loop (docs/accum.md, "What the model must do"). Explicit mode here looks
    up inside `jax.shard_map` instead: each device gathers its own ids from its
    block of the table, whose in_spec carries the table's tags, so the cotangent
    is a local scatter-add that stays unreduced, with no collective at all.

    The table's first (vocab) dim must be unsharded. The output is sharded like
    `ids`, plus the table's embedding-dim partition; `out_spec` reshards it after.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> table_VxD = jax.device_put(jnp.ones((6, 2)), NamedSharding(mesh, P()))
    >>> ids_BxS = jax.device_put(jnp.zeros((8, 3), jnp.int32), NamedSharding(mesh, P("data")))
    >>> with jax.set_mesh(mesh):
    ...     jax.typeof(pt.embed_lookup(table_VxD, ids_BxS))
    ShapedArray(float32[8@data,3,2])
    """
    ids_spec, table_spec = spec_of(ids), spec_of(table)
    if ids_spec is None or table_spec is None:
        return table.at[ids].get()
    table_parts = partitions(table_spec) + (None,) * (table.ndim - len(partitions(table_spec)))
    if table_parts[0] is not None:
        raise ValueError(
            f"embed_lookup needs the table's vocab dim unsharded; table spec is {table_spec} "
            "(reshard it with carry_reduced_axes(P(None, ...), table) first)"
        )
    lead = partitions(ids_spec) + (None,) * (ids.ndim - len(partitions(ids_spec)))
    rows_spec = P(*lead, *table_parts[1:])
    mesh = jax.typeof(table).sharding.mesh
    rows = jax.shard_map(
        lambda table_block, ids_block: table_block[ids_block],
        mesh=mesh,
        # TAG: the table's own spec, tags included: an untagged in_spec here would
        # make shard_map psum the table's cotangent inside the body.
        in_specs=(table_spec, P(*lead)),
        out_specs=rows_spec,
    )(table, ids)
    if out_spec is not None and untagged(out_spec) != rows_spec:
        # TAG: rows are activations (no tag to keep); untagged, as a rebuilt spec is.
        rows = jax.reshard(rows, untagged(out_spec))
    return rows


def unreduced_sum(x: jax.Array) -> jax.Array:
    """Σ of every element of `x`, left `unreduced` over the mesh axes sharding `x`.

    `jnp.sum` of a sharded array all-reduces its scalar on the spot. A loss sum
    or a token count computed once per microbatch only needs its total once per
    step: as per-device partial sums (unreduced) it adds up across microbatches
    with no collective, and one reshard reduces it after the loop (accum does
    this with the gradients). Differentiating it is communication-free too: its
    cotangent is reduced, i.e. the same 1 on every device.

    A plain `jnp.sum` where `x` is not sharded over an explicit axis (auto mode,
    one device, inside shard_map), so callers need no mode switch.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> x_BxD = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> with jax.set_mesh(mesh):
    ...     jax.typeof(jax.jit(pt.unreduced_sum)(x_BxD))
    ShapedArray(float32[]{U:data})
    """
    spec = spec_of(x)
    axes = set(mesh_axes_used(spec)) | set(unreduced_axes(spec)) if spec is not None else set()
    if not axes:
        return jnp.sum(x)
    letters = "abcdefghijklmnopqrstuvwxyz"[: x.ndim]
    # TAG: a contraction over sharded dims may name an unreduced output; jnp.sum
    # takes no out_sharding and would reduce here.
    return jnp.einsum(f"{letters}->", x, out_sharding=with_unreduced(P(), axes))


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Inside `jax.shard_map`: the manual mesh axes `x` is typed varying over.

    A value computed from a shard that differs per device (a weight split over
    'tensor', a device's own rows) varies over that axis; one every device holds
    alike is invariant. JAX 0.10+ keeps the type in `aval.manual_axis_type`,
    earlier releases in `aval.vma`. Outside a shard_map: the empty set.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> def body(w_1):  # the same on every device (in_specs=P())
    ...     v_1 = pt.to_varying(w_1, "data")
    ...     return jnp.stack([len(pt.varying_axes(w_1)), len(pt.varying_axes(v_1))])
    >>> f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"))
    >>> f(jnp.ones(1)).tolist()[:2]
    [0, 1]
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(getattr(manual, "varying", None) or ())
    return frozenset(getattr(aval, "vma", None) or ())


def to_varying(x: jax.Array, axis: str) -> jax.Array:
    """Inside `jax.shard_map`: mark an invariant value as varying over `axis`.

    A no-op on values; it changes the transpose. The gradient of an invariant
    value used with varying data is psummed where it arises, the gradient of a
    varying one stays per device. `lax.pcast` where JAX has it, else `lax.pvary`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> def body(v_1):  # v_1 is the same on every device (in_specs=P())
    ...     return pt.to_varying(v_1, "data") * 2  # without it out_specs=P("data") raises
    >>> jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"))(jnp.ones(1)).tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    """
    cast = getattr(lax, "pcast", None)
    if cast is not None:
        return cast(x, axis, to="varying")
    return lax.pvary(x, axis)  # older JAX
