"""Gradient accumulation over microbatches with one gradient reduction per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from accum.gating import batch_axes_of, deferred_axes, resolve_mode
from accum.guard import find_dropped_tags, report_dropped_tags
from accum.microbatch import split_microbatches
from accum.tags import (
    leaf_axes,
    reduce_to,
    reduce_unreduced,
    safe_inverse,
    tag_reduced,
    unreduced_zeros,
)
from pspec_tags import check_unreduced, spec_of

ON_TAG_LOST = ("raise", "warn", "ignore")


def _check_option(on_tag_lost: str) -> None:
    if on_tag_lost not in ON_TAG_LOST:
        raise ValueError(f"on_tag_lost={on_tag_lost!r} is not one of {ON_TAG_LOST}")


def microbatch_grads(
    loss_fn: Callable,
    params: Any,
    microbatch: Any,
    rng: jax.Array | None,
    axes: tuple[str, ...],
    on_tag_lost: str,
) -> tuple[jax.Array, dict, Any]:
    """(loss_sum, aux, grads) of one microbatch; `params` already tagged over `axes`.

    With `axes`, the gradients come out unreduced over them. Both guards run
    here, at trace time: the forward jaxpr is searched for a dropped tag, and
    the gradients' types are checked with `check_unreduced`.
    """
    args = (microbatch,) if rng is None else (microbatch, rng)
    if axes and on_tag_lost != "ignore":
        report_dropped_tags(find_dropped_tags(loss_fn, params, *args, axes=axes), axes, on_tag_lost)
    (loss_sum, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
    if "weight" not in aux:
        raise KeyError("loss_fn's aux must hold 'weight' (the number of counted targets)")
    if axes and on_tag_lost != "ignore":
        check_grads_unreduced(grads, params, axes, warn_only=on_tag_lost == "warn")
    return loss_sum, aux, grads


def check_grads_unreduced(grads: Any, params: Any, axes: tuple[str, ...], warn_only: bool) -> None:
    """`check_unreduced` per group of parameters sharing the same deferred axes.

    Each gradient must be unreduced over the `leaf_axes` of its own parameter
    (all of `axes` unless the parameter is itself sharded over one of them).
    """
    expected = jax.tree.map(lambda p: leaf_axes(spec_of(p), axes), params)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731 - a leaf test for the tree above
    for group in {a for a in jax.tree.leaves(expected, is_leaf=is_axes) if a}:
        # Leaves of other groups become None, which tree flattening skips.
        subset = jax.tree.map(
            lambda g, want, group=group: g if want == group else None,
            grads,
            expected,
            is_leaf=lambda x: x is None,
        )
        check_unreduced(subset, group, warn_only=warn_only)


def add_grads(acc: Any, grads: Any) -> Any:
    """acc + grads in the accumulator's dtype (unreduced + unreduced stays unreduced)."""
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)


def normalize(loss_sum: jax.Array, aux: dict, grads: Any) -> tuple[jax.Array, dict, Any]:
    """Divide loss and (already reduced) grads by the total weight; zero weight gives zeros.

    Loss and aux sums a `loss_fn` kept unreduced (`pspec_tags.unreduced_sum`)
    are reduced here first: once per step, after the loop, like the gradients.
    """
    loss_sum, aux = reduce_unreduced((loss_sum, aux))
    inv = safe_inverse(aux["weight"])
    loss = loss_sum * inv.astype(loss_sum.dtype)
    grads = jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)
    return loss, aux, grads


def accumulate_gradients(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    *,
    num_microbatches: int,
    mode: str | None = None,
    defer_reduction: bool = True,
    batch_axes: tuple[str, ...] | None = None,
    grad_shardings: Any = None,
    rng: jax.Array | None = None,
    on_tag_lost: str = "raise",
    accum_dtype: Any = jnp.float32,
    per_parameter_axes: bool = False,
) -> tuple[jax.Array, dict, Any]:
    """Loss, summed aux and gradients of `batch`, computed over `num_microbatches` microbatches.

    `loss_fn(params, microbatch[, rng]) -> (loss_sum, aux)`, with `aux["weight"]`
    the number of counted targets. Returns `loss = Σ loss_sum / Σ weight`,
    `aux` summed over microbatches (weight included) and
    `grads = Σ ∇loss_sum / Σ weight`: the full-batch result. Zero total weight
    gives zero loss and grads. With `rng`, microbatch i gets `fold_in(rng, i)`.

    Call it inside `jax.jit`. The microbatch loop is one `lax.scan` over a
    strided, communication-free split of every leaf's leading dimension.

    Explicit mode (inferred from the parameters' shardings, or `mode=`): the
    parameters are resharded to `reduced` over the deferrable batch axes (see
    `gating.deferred_axes`; default batch axes: those sharding `batch`), the
    scan carry holds `unreduced` partial sums, and one reshard after the loop
    reduces them onto `grad_shardings` (default: the parameters' own
    partitions; pass the optimizer's shardings for ZeRO-1). A tag dropped inside
    `loss_fn` raises `TagLostError` at trace time (`on_tag_lost="warn"` warns,
    `"ignore"` skips the guards). `defer_reduction=False` keeps parameters
    untagged so every microbatch reduces its own gradients (for comparison).
    `per_parameter_axes=True` defers, for each parameter, every batch axis
    that does not shard it: right when the only parameters sharded over a
    batch axis are consumed inside `shard_map` kernels (experts over
    'expert'), where the manual region sums them itself. Matmuls outside
    shard_map need the global gating (JAX types their gradient as unreduced
    over every batch axis they contract).

    Auto mode: same numerics, no tags; XLA places the reductions.
    Gradients come back in `accum_dtype` (None: each parameter's dtype).
    """
    _check_option(on_tag_lost)
    mode = resolve_mode(mode, params)
    microbatches = split_microbatches(batch, num_microbatches)
    axes: tuple[str, ...] = ()
    if mode == "explicit" and defer_reduction:
        batch_axes = batch_axes if batch_axes is not None else batch_axes_of(batch)
        # Global gating drops any batch axis that shards some parameter; per
        # parameter, each leaf defers the batch axes that do not shard it.
        axes = tuple(batch_axes) if per_parameter_axes else deferred_axes(params, batch_axes)
    # Free cast outside the loop: forward reads of a reduced array are reads of
    # a replicated one; only the cotangents change type (to unreduced).
    compute_params = tag_reduced(params, axes)
    acc0 = unreduced_zeros(params, axes, accum_dtype)

    def body(acc, xs):
        index, microbatch = xs
        mb_rng = None if rng is None else jax.random.fold_in(rng, index)
        loss_sum, aux, grads = microbatch_grads(
            loss_fn, compute_params, microbatch, mb_rng, axes, on_tag_lost
        )
        # The carry stays unreduced: no collective for the gradients in the loop.
        return add_grads(acc, grads), (loss_sum, aux)

    indices = jnp.arange(num_microbatches, dtype=jnp.uint32)
    acc, (loss_sums, auxes) = jax.lax.scan(body, acc0, (indices, microbatches))
    # Per-microbatch losses/aux are stacked by the scan and summed here: scalars.
    loss_sum = jnp.sum(loss_sums, axis=0)
    aux = jax.tree.map(lambda a: jnp.sum(a, axis=0), auxes)
    # The one gradient reduction of the step (all-reduce, or reduce-scatter onto
    # ZeRO-1 shardings). Normalizing afterwards keeps the scale off unreduced
    # values (an unreduced array times a replicated scalar does not type-check).
    grads = reduce_to(acc, grad_shardings, mode)
    return normalize(loss_sum, aux, grads)
