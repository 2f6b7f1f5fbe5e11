"""The tag moves of a reduction plan: tag, accumulate (unreduced or scattered), reduce once.

Every function reads the `ReductionPlan` (accum.plan); leaves the plan does not
tag (auto mode, per-microbatch policy) degrade to plain operations.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum.plan import ReductionPlan, accumulator_dtype, is_floating, make_plan, mesh_shape_of
from pspec_tags import (
    entry_axes,
    entry_from_axes,
    partitions,
    spec_of,
    unreduced_axes,
    untagged,
    with_reduced,
)


def _named(value: Any, spec: P) -> NamedSharding:
    return NamedSharding(jax.typeof(value).sharding.mesh, spec)


def as_plan(params: Any, plan_or_axes: Any) -> Any:
    """A `ReductionPlan` as given, or (for an axes tuple) the deferred plan over those
    axes, each leaf deferring the ones that do not shard it."""
    if isinstance(plan_or_axes, ReductionPlan):
        return plan_or_axes
    leaves = jax.tree.leaves(params)
    return make_plan(params, batch_axes=tuple(plan_or_axes), mesh_shape=mesh_shape_of(leaves))


def tag_reduced(params: Any, plan: Any) -> Any:
    """Reshard each parameter to `reduced` over its plan's `tagged` axes (a free cast).

    A reduced array is physically replicated, so the forward pass is unchanged;
    the point is the cotangent type: autodiff maps reduced primals to unreduced
    cotangents, so each microbatch's gradients stay per-device partial sums.
    `plan`: a `ReductionPlan` (or a tuple of deferred axes).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> with jax.set_mesh(mesh):
    ...     tagged = jax.eval_shape(lambda w: accum.tag_reduced(w, ("data",)), w)
    >>> pt.reduced_axes(tagged.sharding.spec)
    frozenset({'data'})
    """
    if not plan:
        return params
    plan = as_plan(params, plan)

    def tag(leaf_plan, p):
        spec = spec_of(p)
        if spec is None or not is_floating(p) or not leaf_plan.tagged:
            return p
        # TAG: reduced over the tagged axes makes the cotangent unreduced there (the
        # deferral itself); with_reduced keeps partitions and existing tags.
        return jax.reshard(p, _named(p, with_reduced(spec, leaf_plan.tagged)))

    return plan.map(tag, params)


def unreduced_zeros(params: Any, plan: Any, dtype: Any | None) -> Any:
    """Zero accumulators for `params`, typed as the plan's accumulators, in `dtype`.

    Each is laid out on its leaf's `accumulator_spec` and `unreduced` over its
    `per_step` axes. The carry must have the same type as what it adds up: an
    untagged (replicated) zero plus an unreduced gradient would force the
    gradient's all-reduce at the addition, inside the loop.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> with jax.set_mesh(mesh):
    ...     acc = jax.eval_shape(lambda w: accum.unreduced_zeros(w, ("data",), jnp.float32), w)
    >>> pt.unreduced_axes(acc.sharding.spec)
    frozenset({'data'})
    """
    plan = as_plan(params, plan) if plan else None

    def zeros(leaf_plan, p):
        dt = accumulator_dtype(p, dtype)
        if spec_of(p) is None or leaf_plan is None or not leaf_plan.tagged:
            return jnp.zeros_like(p, dtype=dt)
        # TAG: the accumulator's type comes from the plan (partitions, unreduced
        # over the per-step axes); a reduced tag on the parameter is not copied.
        target = leaf_plan.accumulator_target
        return lax.broadcast_in_dim(jnp.zeros((), dt), p.shape, (), out_sharding=_named(p, target))

    if plan is None:
        return jax.tree.map(lambda p: zeros(None, p), params)
    return plan.map(zeros, params)


def scatter_into(grads: Any, plan: Any) -> Any:
    """Reduce each gradient over its leaf's `scatter` axes, onto its accumulator type.

    The hierarchical plan's per-microbatch step: the in-slice partial sums are
    reduce-scattered into the sharded accumulator (psummed where the leaf is too
    small to split), the per-step axes stay unreduced. Leaves without scatter
    axes pass through.
    """

    scattered = plan.map(lambda leaf_plan, g: scatter_leaf(leaf_plan, g), grads)
    if not plan.scatters:
        return scattered
    # XLA (TPU's while-loop all-reduce code motion) would otherwise sink a
    # reduce-scatter whose result is only accumulated out of the loop: the same
    # numbers, but the accumulator turns back into a full-size unreduced one,
    # which is the memory this schedule exists to save. The barrier keeps it here.
    return lax.optimization_barrier(scattered)


def scatter_leaf(leaf_plan: Any, g: jax.Array, target: P | None = None) -> jax.Array:
    """One gradient reduced over its leaf's `scatter` axes onto `target` (default: the
    leaf's accumulator type; a layer slice's when `accum.scan_layers` passes it);
    unchanged without scatter axes or outside explicit mode."""
    own = spec_of(g)
    if own is None or not leaf_plan.scatter:
        return g
    target = leaf_plan.accumulator_target if target is None else target
    dims = _scatter_dims(own, target)
    return _reduce_scatter(g, own, target, dims, keep=leaf_plan.per_step)


def zeros_of_type(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `struct`'s shape, dtype and explicit sharding, tags included.

    For accumulators of loss and aux sums: a `loss_fn` may return them unreduced
    (`pspec_tags.unreduced_sum`), and adding an unreduced value to an untagged
    zero would reduce it at the addition, once per microbatch.
    """
    sharding = getattr(struct, "sharding", None)
    if not isinstance(sharding, NamedSharding) or spec_of(struct) is None:
        return jnp.zeros(struct.shape, struct.dtype)
    # TAG: the zero takes the sum's own type, unreduced tag included, so adding
    # an unreduced loss/aux sum to it is local (no per-microbatch all-reduce).
    return lax.broadcast_in_dim(
        jnp.zeros((), struct.dtype), struct.shape, (), out_sharding=sharding
    )


def reduce_unreduced(tree: Any) -> Any:
    """Each unreduced leaf resharded onto its own partitions, untagged: its one all-reduce."""

    def reduce(x):
        spec = spec_of(x)
        if spec is None or not unreduced_axes(spec):
            return x
        # TAG: onto its own partitions, untagged: this is the sum's one all-reduce.
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
        # TAG: untagged destination: dropping `unreduced` here is the point (the
        # reduction), and a reduced tag could not coexist with the unreduced source.
        return jax.reshard(x, _named(x, destination))
    if spec is None:
        return x
    # TAG: auto mode cannot carry tags: stripped, XLA places the reduction.
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
        axes = entry_axes(dst)
        if src is not None or not axes or not set(axes) <= unreduced:
            return {}
        scatter[dim] = axes
    return scatter


def _reduce_scatter(
    x: jax.Array, own: P, destination: P, scatter: dict, keep: tuple[str, ...] = ()
) -> jax.Array:
    """The reduction as a reduce-scatter: each device keeps only its shard of the sum.

    `jax.reshard` from unreduced onto a spec sharded over the unreduced axis
    compiles to a full all-reduce then a slice (XLA:CPU and TPU alike): twice
    the traffic of a reduce-scatter and a full-size temporary. A shard_map
    taking the value with its own (unreduced) spec does it with psum_scatter;
    unreduced axes that shard nothing in the destination are psummed, except
    `keep`: those stay unreduced (the destination is unreduced over them).
    """
    scattered = {a for axes in scatter.values() for a in axes}
    rest = tuple(a for a in unreduced_axes(own) if a not in scattered and a not in keep)

    def body(block):
        for dim, axes in scatter.items():
            block = lax.psum_scatter(
                block, entry_from_axes(axes), scatter_dimension=dim, tiled=True
            )
        if rest:
            block = lax.psum(block, rest)
        return block

    mesh = jax.typeof(x).sharding.mesh
    # TAG: the in_spec is the value's own spec, unreduced tag included: it
    # tells shard_map the blocks are partial sums still to be added up; the
    # out_spec keeps `keep` unreduced (sums still owed across slices).
    return jax.shard_map(body, mesh=mesh, in_specs=own, out_specs=destination)(x)


def is_target_leaf(t: Any) -> bool:
    """Whether `t` is a leaf of a targets tree: None, a PartitionSpec or a NamedSharding."""
    return t is None or isinstance(t, P | NamedSharding)


def reduce_to(grads: Any, targets: Any, mode: str) -> Any:
    """Place accumulated gradients on `targets`: in explicit mode this is THE reduction.

    `targets` is None or a pytree matching `grads` whose leaves are
    PartitionSpecs, NamedShardings or None (None: the gradient's own partitions).
    """
    if targets is None:
        return jax.tree.map(lambda g: place(g, None, mode), grads)
    return jax.tree.map(lambda t, g: place(g, t, mode), targets, grads, is_leaf=is_target_leaf)


def place_tree(tree: Any, targets: Any, mode: str) -> Any:
    """`place` over a pytree (targets: matching pytree of specs/shardings, or None)."""
    return reduce_to(tree, targets, mode)


def safe_inverse(weight: jax.Array) -> jax.Array:
    """1/weight, and 0 where weight is 0: an all-padding step yields zeros, never NaN.
    Only zero: a negative total weight (weights that are signed coefficients) divides
    as the full-batch objective does, rather than silently zeroing the step."""
    nonzero = weight != 0
    return jnp.where(nonzero, 1.0 / jnp.where(nonzero, weight, 1.0), 0.0)
