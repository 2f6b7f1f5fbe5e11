"""Choosing the accumulation path: tags where the model traces under them, else local.

`tags` (accum.tags): parameters resharded to `reduced`, gradients typed
`unreduced`; JAX's explicit sharding carries the deferral through the model.
It needs every op between a reduced weight and a batch-sharded activation to
have a sharding rule for it, and every library on the way to accept a tagged
PartitionSpec. On JAX 0.10.2 stock Flax layers do not: a bias add or a norm
scale raises a ShardingTypeError, `Embed` and `nn.scan` unpack the spec (the
"dangerous *pspec" ValueError), `Conv` has no reduced rule (NotImplementedError).

`local` (accum.local): each microbatch inside a shard_map over the batch
axes; any model, auto meshes too.

`auto` tries the tags path by tracing one microbatch's loss and gradient
(`jax.eval_shape`: no compute) and falls back to `local` on exactly those
errors, saying which in the plan (`summary()`, `table()`, `path_reason`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax

from accum.local import local_accumulate, shortened
from accum.microbatch import split_microbatches
from accum.plan import ReductionPlan, make_plan
from accum.seed import value_and_grad
from accum.tags import tag_reduced

# JAX's ValueErrors about a tagged value: flax unpacking a tagged spec, a reshape
# onto a spec that lost the tag.
_REFUSAL = re.compile(r"unreduced/reduced set|must be (?:un)?reduced over|(?:un)?reduced axes")


def _tags_refused(error: Exception) -> bool:
    """Whether `error` is the model refusing tags (not a bug in the model)."""
    if type(error).__name__ == "ShardingTypeError" or isinstance(error, NotImplementedError):
        return True
    # flax unpacking a tagged spec: "Using *pspec is dangerous when PartitionSpec has
    # non-empty unreduced/reduced set". Other ValueErrors (no mesh context, shapes)
    # are the caller's to see, as on the tags path.
    return isinstance(error, ValueError) and _REFUSAL.search(str(error)) is not None


def _unbound_batch_axis(error: Exception, plan: ReductionPlan) -> bool:
    """Whether `error` is JAX refusing a collective over one of `plan`'s batch axes
    outside a shard_map ("Found an unbound axis name: data")."""
    found = re.search(r"unbound axis name: (\S+?)\.?(?:\s|$)", str(error))
    return isinstance(error, NameError) and found is not None and found.group(1) in plan.batch_axes


def local_plan(plan: ReductionPlan, params: Any, reason: str) -> ReductionPlan:
    """`plan`'s mesh and batch axes on the local path, with `reason`."""
    local = make_plan(
        params,
        batch_axes=plan.batch_axes,
        mesh_shape=dict(plan.mesh_shape),
        mode=plan.mode,
        path="local",
    )
    return dataclasses.replace(local, path_reason=reason)


def choose_path(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    *,
    num_microbatches: int,
    plan: ReductionPlan,
    rng: jax.Array | None = None,
) -> ReductionPlan:
    """`plan` with its path decided: unchanged unless `plan.path == "auto"`; then
    "tags" when one microbatch's loss and gradient trace under the tags (or
    there is nothing to tag), else the local path, its `path_reason` naming the
    error the tags met. Traces only (no compute); call it where
    `accumulate_gradients` would be called to see the plan it will use.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> def biased(p, mb):  # a bias added to batch-sharded rows: no reduced rule
    ...     return jnp.sum(mb["x"] + p["b"]), {"weight": jnp.float32(mb["x"].shape[0])}
    >>> b = {"b": jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))}
    >>> with jax.set_mesh(mesh):
    ...     plan = accum.choose_path(biased, b, batch, num_microbatches=2,
    ...                              plan=accum.plan_for(b, batch))
    >>> plan.path, plan.path_reason[:40]
    ('local', 'tags refused: ShardingTypeError: Input')
    """
    if plan.path != "auto":
        return plan
    if plan.mode != "explicit":
        return _auto_mesh_path(loss_fn, params, batch, num_microbatches, plan, rng)
    if not plan.tagged_axes:
        return dataclasses.replace(plan, path="tags")
    args = () if rng is None else (rng,)

    def one_microbatch(params, batch, *args):
        microbatch = jax.tree.map(lambda x: x[0], split_microbatches(batch, num_microbatches))
        return value_and_grad(loss_fn)(tag_reduced(params, plan), microbatch, *args)

    try:
        jax.eval_shape(one_microbatch, params, batch, *args)
    except Exception as error:  # noqa: BLE001 - only the tag refusals fall back, below
        if _unbound_batch_axis(error, plan):
            # A collective over a batch axis (a sync BatchNorm's pmean) needs the axis
            # bound: the local path's shard_map binds it (accum.batch_collectives).
            first = shortened(str(error).strip().splitlines()[0])
            return local_plan(plan, params, f"loss_fn runs a collective over a batch axis: {first}")
        if not _tags_refused(error):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return local_plan(plan, params, f"tags refused: {type(error).__name__}: {shortened(first)}")
    return dataclasses.replace(plan, path="tags")


def _auto_mesh_path(loss_fn, params, batch, num_microbatches, plan, rng) -> ReductionPlan:
    """On an auto mesh: the local path (tags cannot defer there), unless the model
    cannot run inside its shard_map (a sharding constraint naming a batch axis);
    then XLA places the reductions, per microbatch, and the plan says why."""
    local = local_plan(plan, params, "auto mode carries no reduced/unreduced tags")
    try:
        jax.eval_shape(
            lambda p, b, *r: local_accumulate(
                loss_fn,
                p,
                b,
                num_microbatches=num_microbatches,
                plan=local,
                rng=r[0] if r else None,
                grad_shardings=None,
                accum_dtype=None,
            ),
            params,
            batch,
            *(() if rng is None else (rng,)),
        )
    except Exception as error:  # noqa: BLE001 - the fallback is the pre-local behaviour
        first = (str(error).strip().splitlines() or [""])[0]
        reason = f"the local path failed: {type(error).__name__}: {shortened(first)}"
        return dataclasses.replace(plan, path="tags", path_reason=reason)
    return local
