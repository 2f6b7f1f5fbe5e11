"""ZeRO-1: optimizer state and master parameters sharded over the data axis.

Per step: the data-sharded f32 masters are cast (optionally to bf16) and
gathered once, before the microbatch loop; gradients accumulate unreduced; the
one reduction after the loop lands straight in the sharded layout (a
reduce-scatter where the backend forms one); the optimizer updates shards only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum.accumulate import accumulate_gradients
from accum.gating import plan_for, resolve_mode
from accum.plan import is_floating
from accum.shards import add_axis_to_free_dim
from accum.step import optimizer_update
from accum.tags import as_spec, is_target_leaf, place, place_tree
from pspec_tags import spec_of, untagged


def check_zero1_compatible(
    mesh: Any, *, data_axis: str = "data", fsdp_axes: Iterable[str] = ("fsdp",)
) -> None:
    """Reject ZeRO-1 on a mesh that also does FSDP, naming both settings (ValueError).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> fsdp_mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    >>> accum.check_zero1_compatible(fsdp_mesh)
    Traceback (most recent call last):
    ...
    ValueError: ZeRO-1 (zero1_shardings / shard_optimizer_over_data) cannot be combined ...
    """
    sizes = dict(mesh.shape)
    if data_axis not in sizes:
        raise ValueError(f"ZeRO-1 shards over mesh axis {data_axis!r}, absent from {tuple(sizes)}")
    for axis in fsdp_axes:
        if sizes.get(axis, 1) > 1:
            raise ValueError(
                f"ZeRO-1 (zero1_shardings / shard_optimizer_over_data) cannot be combined with "
                f"FSDP (mesh axis {axis!r} of size {sizes[axis]}, fsdp parallelism > 1): FSDP "
                f"already shards parameters and optimizer state. Use one of the two."
            )


def _spec_and_mesh(leaf: Any) -> tuple[P, Any]:
    spec = spec_of(leaf)
    sharding = getattr(leaf, "sharding", None)
    if spec is None and isinstance(sharding, NamedSharding):
        spec = sharding.spec
    return (spec if spec is not None else P()), getattr(sharding, "mesh", None)


def zero1_shardings(
    params: Any,
    mesh: Any = None,
    *,
    data_axis: str = "data",
    fsdp_axes: Iterable[str] = ("fsdp",),
) -> Any:
    """NamedShardings for ZeRO-1 master parameters (and their optimizer state).

    Each leaf keeps its own partitions (tensor/expert) and gains `data_axis` on
    the first dimension it divides; leaves too small stay replicated. `params`
    may hold arrays or ShapeDtypeStructs with shardings; `mesh` defaults to
    theirs. Raises ValueError when the mesh also does FSDP.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> pt.mesh_axes_used(accum.zero1_shardings({"w": w})["w"].spec)  # w is replicated
    ('data',)
    """
    leaves = jax.tree.leaves(params)
    if mesh is None:
        mesh = next((m for m in (_spec_and_mesh(x)[1] for x in leaves) if m is not None), None)
    if mesh is None:
        raise ValueError("zero1_shardings needs a mesh: pass mesh= or params with shardings")
    check_zero1_compatible(mesh, data_axis=data_axis, fsdp_axes=fsdp_axes)
    sizes = dict(mesh.shape)

    def one(leaf):
        spec, _ = _spec_and_mesh(leaf)
        return NamedSharding(mesh, add_axis_to_free_dim(spec, tuple(leaf.shape), sizes, data_axis))

    return jax.tree.map(one, params)


def zero1_state_shardings(opt_state: Any, params: Any, master_shardings: Any, mesh: Any) -> Any:
    """Shardings for an optimizer state: every subtree shaped like `params` (Adam's
    mu and nu, say) gets `master_shardings`; other leaves (step counts) are replicated.

    `opt_state` may be abstract (`jax.eval_shape(optimizer.init, params)`).
    Use as `jax.jit(optimizer.init, out_shardings=...)` so auto mode shards it too.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> masters = accum.zero1_shardings({"w": w})
    >>> state = {"mu": {"w": w}, "count": jnp.zeros((), jnp.int32)}  # Adam-like
    >>> shardings = accum.zero1_state_shardings(state, {"w": w}, masters, mesh)
    >>> pt.mesh_axes_used(shardings["mu"]["w"].spec), pt.mesh_axes_used(shardings["count"].spec)
    (('data',), ())
    """
    target = jax.tree.structure(params)
    replicated = NamedSharding(mesh, P())

    def one(node):
        if jax.tree.structure(node) == target:
            return master_shardings
        return replicated

    return jax.tree.map(one, opt_state, is_leaf=lambda n: jax.tree.structure(n) == target)


def zero1_gather(
    master_params: Any,
    compute_shardings: Any,
    *,
    compute_dtype: Any = None,
    cast: Any = None,
    mode: str | None = None,
) -> Any:
    """The masters gathered onto `compute_shardings`: ZeRO-1's once-per-step gather.

    Each master is cast to `compute_dtype` first (all of them, or those `cast`,
    a pytree of bools shaped like the masters, marks), so the all-gather moves
    compute-dtype bytes. The target is untagged: `accumulate_gradients` then
    tags the gathered copies itself. A leaf already in place is not moved.
    `compute_shardings` leaves: PartitionSpecs, NamedShardings or None (leave it).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> master = jax.device_put({"w": w}, accum.zero1_shardings({"w": w}))  # over 'data'
    >>> with jax.set_mesh(mesh):
    ...     gather = jax.jit(lambda m: accum.zero1_gather(m, {"w": P()}, compute_dtype="bfloat16"))
    ...     gathered = gather(master)["w"]
    >>> pt.mesh_axes_used(gathered.sharding.spec), str(gathered.dtype)
    ((), 'bfloat16')
    """
    mode = resolve_mode(mode, master_params)
    if cast is None:
        cast = jax.tree.map(lambda _: True, master_params)

    def gather(target, p, c):
        # Floating leaves only: a bool mask or an int counter cast to bf16 would be
        # taken for a trainable weight (and its "update" cast back into it).
        q = p.astype(compute_dtype) if compute_dtype is not None and c and is_floating(p) else p
        spec = as_spec(target)
        if spec is None or (mode == "explicit" and spec_of(q) == untagged(spec)):
            # Already there: a reshard would be a new value, which a shard_map
            # inside a scanned layer saves as a residual (see pspec_tags.shard).
            return q
        # TAG: untagged on purpose: accumulate_gradients then tags the gathered copies
        # reduced over the batch axes, so the loop carries unreduced sums as usual.
        return place(q, target, mode)

    return jax.tree.map(gather, compute_shardings, master_params, cast, is_leaf=is_target_leaf)


def zero1_step(
    loss_fn: Callable,
    optimizer: Any,
    master_params: Any,
    opt_state: Any,
    batch: Any,
    *,
    num_microbatches: int,
    compute_shardings: Any,
    master_shardings: Any = None,
    compute_dtype: Any = None,
    mode: str | None = None,
    **accum_kwargs: Any,
) -> tuple[Any, Any, jax.Array, dict]:
    """One ZeRO-1 optimizer step; returns `(master_params, opt_state, loss, aux)`.

    `master_params` are data-sharded (`zero1_shardings`); `compute_shardings`
    are the layouts the model computes with (the non-ZeRO parameter shardings).
    `master_shardings` defaults to the masters' own shardings in explicit mode
    (required in auto mode). Call inside `jax.jit`.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> master = jax.device_put({"w": w}, accum.zero1_shardings({"w": w}))  # over 'data'
    >>> with jax.set_mesh(mesh):
    ...     step = jax.jit(
    ...         lambda m, s, b: accum.zero1_step(
    ...             lambda p, mb: loss_fn(p["w"], mb),
    ...             SGD(),
    ...             m,
    ...             s,
    ...             b,
    ...             num_microbatches=2,
    ...             compute_shardings={"w": P()},
    ...         )
    ...     )
    ...     master, state, loss, aux = step(master, (), batch)
    >>> float(loss), master["w"].tolist()[:2], pt.mesh_axes_used(master["w"].sharding.spec)
    (8.0, [0.5, 0.5], ('data',))
    """
    mode = resolve_mode(mode, master_params)
    if master_shardings is None:
        if mode != "explicit":
            raise ValueError("zero1_step in auto mode needs master_shardings=")
        master_shardings = jax.tree.map(lambda p: untagged(spec_of(p)), master_params)

    params = zero1_gather(master_params, compute_shardings, compute_dtype=compute_dtype, mode=mode)
    # grad_shardings = the masters' layout: the single post-loop reduction
    # lands there directly (reduce-scatter), never as a full all-reduce + slice.
    plan = accum_kwargs.pop("plan", None)
    if plan is None:
        plan = plan_for(params, batch, mode=mode)
    loss, aux, grads = accumulate_gradients(
        loss_fn,
        params,
        batch,
        num_microbatches=num_microbatches,
        plan=plan,
        grad_shardings=master_shardings,
        **accum_kwargs,
    )
    new_master, opt_state = optimizer_update(optimizer, grads, opt_state, master_params)
    # TAG: the updated masters leave on the masters' own untagged shards.
    return place_tree(new_master, master_shardings, mode), opt_state, loss, aux
