"""The three tag moves of deferred reduction: tag, accumulate unreduced, reduce once.

Every function takes the `axes` chosen by `gating.deferred_axes`; with `axes`
empty (auto mode, or no deferrable axis) they degrade to plain operations.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pspec_tags import (
    mesh_axes_used,
    partitions,
    spec_of,
    unreduced_axes,
    untagged,
    with_reduced,
    with_unreduced,
)


def _floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _named(value: Any, spec: P) -> NamedSharding:
    return NamedSharding(jax.typeof(value).sharding.mesh, spec)


def leaf_axes(spec: P | None, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The deferred axes that apply to one parameter: `axes` minus those sharding it.

    A spec cannot be reduced over an axis that partitions it, and a parameter
    sharded over a batch axis (experts over 'expert') is summed over that axis
    by its own kernel, so only the remaining batch axes are deferred for it.
    """
    used = set(mesh_axes_used(spec))
    return tuple(a for a in axes if a not in used)


def tag_reduced(params: Any, axes: tuple[str, ...]) -> Any:
    """Reshard each floating parameter to `reduced` over its `leaf_axes` (a free cast).

    A reduced array is physically replicated, so the forward pass is unchanged;
    the point is the cotangent type: autodiff maps reduced primals to unreduced
    cotangents, so each microbatch's gradients stay per-device partial sums.
    """
    if not axes:
        return params

    def tag(p):
        spec = spec_of(p)
        if spec is None or not _floating(p) or not leaf_axes(spec, axes):
            return p
        # with_reduced keeps the partitions and any existing tags (never spec[...]).
        return jax.reshard(p, _named(p, with_reduced(spec, leaf_axes(spec, axes))))

    return jax.tree.map(tag, params)


def unreduced_zeros(params: Any, axes: tuple[str, ...], dtype: Any | None) -> Any:
    """Zero accumulators shaped like `params`, `unreduced` over `axes`, in `dtype`.

    The carry must have the same type as the gradients it adds up: an untagged
    (replicated) zero plus an unreduced gradient would force the gradient's
    all-reduce at the addition, inside the loop.
    """

    def zeros(p):
        dt = dtype if dtype is not None and _floating(p) else jnp.result_type(p)
        spec = spec_of(p)
        if spec is None or not leaf_axes(spec, axes):
            return jnp.zeros_like(p, dtype=dt)
        # Partitions from the parameter, its reduced tag swapped for unreduced
        # (a spec cannot hold the same axis as both).
        target = with_unreduced(P(*partitions(spec)), leaf_axes(spec, axes))
        return lax.broadcast_in_dim(jnp.zeros((), dt), p.shape, (), out_sharding=_named(p, target))

    return jax.tree.map(zeros, params)


def zeros_of_type(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `struct`'s shape, dtype and explicit sharding, tags included.

    For accumulators of loss and aux sums: a `loss_fn` may return them unreduced
    (`pspec_tags.unreduced_sum`), and adding an unreduced value to an untagged
    zero would reduce it at the addition, once per microbatch.
    """
    sharding = getattr(struct, "sharding", None)
    if not isinstance(sharding, NamedSharding) or spec_of(struct) is None:
        return jnp.zeros(struct.shape, struct.dtype)
    return lax.broadcast_in_dim(
        jnp.zeros((), struct.dtype), struct.shape, (), out_sharding=sharding
    )


def reduce_unreduced(tree: Any) -> Any:
    """Each unreduced leaf resharded onto its own partitions, untagged: its one all-reduce."""

    def reduce(x):
        spec = spec_of(x)
        if spec is None or not unreduced_axes(spec):
            return x
        return jax.reshard(x, _named(x, untagged(spec)))

    return jax.tree.map(reduce, tree)


def as_spec(sharding: Any) -> P | None:
    """A PartitionSpec from a NamedSharding, a PartitionSpec, or None."""
    if sharding is None or isinstance(sharding, P):
        return sharding
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    raise TypeError(f"expected a PartitionSpec or NamedSharding, got {type(sharding).__name__}")


def place(x: jax.Array, target: Any, mode: str) -> jax.Array:
    """Put `x` on `target` (PartitionSpec, NamedSharding or None: leave it), tags stripped.

    Explicit mode: `jax.reshard`. From an unreduced value this is a reduction
    (all-reduce; reduce-scatter onto a spec sharded over the unreduced axis);
    from a sharded one a gather. Auto mode: a sharding constraint.
    """
    spec = as_spec(target)
    if mode == "explicit":
        own = spec_of(x)
        if own is None:
            return x
        destination = untagged(spec if spec is not None else own)
        scatter = _scatter_dims(own, destination)
        if scatter:
            return _reduce_scatter(x, own, destination, scatter)
        # Untagged destination: dropping `unreduced` here is the point (the
        # reduction), and a reduced tag could not coexist with the unreduced source.
        return jax.reshard(x, _named(x, destination))
    if spec is None:
        return x
    if isinstance(target, NamedSharding):
        return lax.with_sharding_constraint(x, NamedSharding(target.mesh, untagged(spec)))
    return lax.with_sharding_constraint(x, untagged(spec))


def _scatter_dims(own: P, destination: P) -> dict[int, tuple[str, ...]]:
    """{dim: axes} when `destination` only adds unreduced axes of `own` on dims
    `own` leaves unsharded (ZeRO-1's shards); {} for any other move."""
    unreduced = set(unreduced_axes(own))
    if not unreduced:
        return {}
    source_parts = partitions(own)
    target_parts = partitions(destination)
    width = max(len(source_parts), len(target_parts))
    source_parts += (None,) * (width - len(source_parts))
    target_parts += (None,) * (width - len(target_parts))
    scatter = {}
    for dim, (src, dst) in enumerate(zip(source_parts, target_parts, strict=True)):
        if src == dst:
            continue
        axes = mesh_axes_used(P(dst))
        if src is not None or not axes or not set(axes) <= unreduced:
            return {}
        scatter[dim] = axes
    return scatter


def _reduce_scatter(x: jax.Array, own: P, destination: P, scatter: dict) -> jax.Array:
    """The reduction as a reduce-scatter: each device keeps only its shard of the sum.

    `jax.reshard` from unreduced onto a spec sharded over the unreduced axis
    compiles to a full all-reduce then a slice (XLA:CPU and TPU alike): twice
    the traffic of a reduce-scatter and a full-size temporary. A shard_map
    taking the value with its own (unreduced) spec does it with psum_scatter;
    unreduced axes that shard nothing in the destination are psummed.
    """
    scattered = {a for axes in scatter.values() for a in axes}
    rest = tuple(a for a in unreduced_axes(own) if a not in scattered)

    def body(block):
        for dim, axes in scatter.items():
            axis = axes[0] if len(axes) == 1 else axes
            block = lax.psum_scatter(block, axis, scatter_dimension=dim, tiled=True)
        if rest:
            block = lax.psum(block, rest)
        return block

    mesh = jax.typeof(x).sharding.mesh
    # TAG: the in_spec is the value's own spec, unreduced tag included: it
    # tells shard_map the blocks are partial sums still to be added up.
    return jax.shard_map(body, mesh=mesh, in_specs=own, out_specs=destination)(x)


def _is_target_leaf(t: Any) -> bool:
    return t is None or isinstance(t, P | NamedSharding)


def reduce_to(grads: Any, targets: Any, mode: str) -> Any:
    """Place accumulated gradients on `targets`: in explicit mode this is THE reduction.

    `targets` is None or a pytree matching `grads` whose leaves are
    PartitionSpecs, NamedShardings or None (None: the gradient's own partitions).
    """
    if targets is None:
        return jax.tree.map(lambda g: place(g, None, mode), grads)
    return jax.tree.map(lambda t, g: place(g, t, mode), targets, grads, is_leaf=_is_target_leaf)


def place_tree(tree: Any, targets: Any, mode: str) -> Any:
    """`place` over a pytree (targets: matching pytree of specs/shardings, or None)."""
    return reduce_to(tree, targets, mode)


def safe_inverse(weight: jax.Array) -> jax.Array:
    """1/weight, and 0 where weight is 0: an all-padding step yields zeros, never NaN."""
    positive = weight > 0
    return jnp.where(positive, 1.0 / jnp.where(positive, weight, 1.0), 0.0)
