"""Reading a step's inputs for the reduction plan: the mode, the batch axes, and
the plan itself from traced values. The decisions are accum.plan's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from accum.partition_meta import annotated_axes, auto_batch_axes
from accum.plan import ReductionPlan, make_plan, mesh_shape_of
from pspec_tags import MODES, entry_axes, mesh_axes_used, partitions, spec_of


def resolve_mode(mode: str | None, params: Any) -> str:
    """`mode` if given, else "explicit" when any parameter lives on an Explicit mesh.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> accum.resolve_mode(None, w), accum.resolve_mode(None, jnp.ones(8))
    ('explicit', 'auto')
    """
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        return mode
    leaves = jax.tree.leaves(params)
    return "explicit" if any(spec_of(leaf) is not None for leaf in leaves) else "auto"


def batch_axes_of(batch: Any) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that shard the leading (batch) dimension of `batch`'s leaves.

    Read from the explicit shardings of the leaves, so it works on traced values;
    returns `()` in auto mode, where shardings are not part of the types.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> accum.batch_axes_of(batch)
    ('data',)
    """
    leaves = jax.tree.leaves(batch)
    sizes = mesh_shape_of(leaves)
    axes: list[str] = []
    for leaf in leaves:
        spec = spec_of(leaf)
        if spec is None or getattr(leaf, "ndim", 0) == 0:
            continue
        # `partitions` reads through tags: a tagged spec refuses `spec[0]`.
        lead = partitions(spec)[:1]
        for axis in entry_axes(lead[0] if lead else None):
            if sizes.get(axis, 1) > 1 and axis not in axes:
                axes.append(axis)
    return tuple(axes)


def param_mesh_axes(params: Any) -> frozenset[str]:
    """Mesh axes that partition some dimension of some parameter (tags excluded).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> w_DxF = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "data")))
    >>> sorted(accum.param_mesh_axes({"w": w, "w_DxF": w_DxF}))
    ['data']
    """
    return frozenset(a for leaf in jax.tree.leaves(params) for a in mesh_axes_used(spec_of(leaf)))


def plan_for(
    params: Any,
    batch: Any,
    *,
    policy: str = "deferred",
    mode: str | None = None,
    batch_axes: Iterable[str] | None = None,
    slice_axes: Iterable[str] = (),
    per_parameter: bool = False,
    path: str = "auto",
) -> ReductionPlan:
    """The reduction plan of `params` read from the values themselves: `make_plan`
    with the mesh and specs of `params`' explicit shardings and the batch axes of
    `batch`'s (unless `batch_axes` is given). Works on traced values.

    `policy`: 'deferred', 'per_microbatch' or 'hierarchical' (`slice_axes`: the
    mesh axes across slices). `mode`: 'explicit' or 'auto'; None reads it from
    `params` (`resolve_mode`). `per_parameter=True` defers, per parameter, every
    batch axis that does not shard it: right when the only parameters sharded
    over a batch axis are consumed inside `shard_map` kernels (experts over
    'expert'), where the manual region sums them itself; the default (False)
    reduces a batch axis that shards any parameter per microbatch for all, as
    plain matmuls outside shard_map need (JAX types their gradient as unreduced
    over every batch axis they contract).
    `path`: 'auto' (default: `accumulate_gradients` tries the tags and falls
    back to the local path when the model does not trace under them; auto
    meshes take the local path), 'tags' or 'local' (accum.paths). On an auto
    mesh, whose traced types hold no shardings, the batch axes default to the
    ones sharding a placed batch's leading dimension (under `compile_checked`:
    its arguments', matched by shape and dtype), else to every axis of size > 1
    that no parameter is annotated over (`nn.with_partitioning`,
    `nnx.with_partitioning`: accum.partition_meta); `batch_axes` overrides.
    `accumulate_gradients` and `start` call it when given no plan.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> accum.plan_for({"w": w}, batch).summary()
    "deferred to once per step over ('data',) (grads stay unreduced)"
    >>> accum.plan_for({"w": w}, batch, policy="per_microbatch").summary()
    "per microbatch over ('data',) (policy per_microbatch)"
    """
    model_axes = annotated_axes(params)  # linen's boxes and nnx's metadata
    leaves = jax.tree.leaves(params)
    mode = resolve_mode(mode, params)
    sizes = mesh_shape_of(leaves)
    axes = tuple(batch_axes) if batch_axes is not None else batch_axes_of(batch)
    if mode == "auto":  # its types carry no shardings: the mesh set by `jax.set_mesh`
        sizes = sizes or dict(jax.sharding.get_abstract_mesh().shape)
    if mode == "auto" and path != "tags":
        # Auto mode cannot defer with tags: the local path does.
        # The batch's shardings are not in its traced type: a 'model' axis the
        # parameters are annotated over is never taken for a batch axis.
        if batch_axes is None:
            axes = auto_batch_axes(batch, sizes, model_axes)
        path = "auto" if axes and policy == "deferred" else "tags"
    plan = make_plan(
        params,
        batch_axes=axes,
        mesh_shape=sizes,
        policy=policy,
        mode=mode,
        slice_axes=slice_axes,
        per_parameter=per_parameter,
        path=path,
    )
    return plan


def deferred_axes(params: Any, batch_axes: Iterable[str]) -> tuple[str, ...]:
    """The batch axes the deferred plan (global gating) reduces once per step.

    A read of `make_plan`: the axes of `batch_axes` that shard no parameter and
    have size > 1. Empty in auto mode (no explicit shardings to read).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> w_sharded = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
    >>> accum.deferred_axes(w, ("data",)), accum.deferred_axes(w_sharded, ("data",))
    (('data',), ())
    """
    leaves = jax.tree.leaves(params)
    sizes = mesh_shape_of(leaves)
    if not sizes:
        return ()
    plan = make_plan(params, batch_axes=batch_axes, mesh_shape=sizes, per_parameter=False)
    return plan.deferred_axes


def data_is_only_batch_axis(params: Any, batch_axes: Iterable[str]) -> bool:
    """Whether deferral applies: some batch axis shards the batch and no parameter.

    The gate of the deferred path (named after the seed's helper): when it is
    False, parameters are left untagged and gradients are reduced where the
    model's shardings put them.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> w_sharded = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
    >>> [accum.data_is_only_batch_axis(p, ("data",)) for p in (w, w_sharded)]
    [True, False]
    """
    return bool(deferred_axes(params, batch_axes))
