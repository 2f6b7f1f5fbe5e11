"""The local path: each microbatch's loss and gradient inside a `shard_map` over the batch axes.

Where tags cannot flow (a primitive without a `reduced` sharding rule, a
library that unpacks a tagged PartitionSpec, an elementwise op between a
batch-sharded activation and a reduced bias, or an auto mesh whose types hold
no shardings at all), the same deferral is had by hand: inside a `shard_map`
that makes only the batch axes manual, every device holds the whole weights
(replicated over those axes) and its own rows of each microbatch. Each device
differentiates its rows' loss with respect to a *varying* copy of the weights
(`pcast(..., to="varying")`), so autodiff has nothing to sum across devices:
its gradient is the device's local partial sum. The scan adds those up, and
one `psum` after the loop is the step's only gradient reduction. Any model runs
unchanged inside; axes that are not batch axes stay as they are (explicit or
auto), so a model axis keeps its sharding.

What differs from the full batch: a value the model computes over the batch
dimension (a batch norm's statistics, a contrastive loss's negatives) sees the
device's rows of the microbatch, as under `pmap` or DDP. Dropout keys are
folded with the microbatch index and the device's position on the batch axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from accum.plan import ReductionPlan, is_floating
from accum.seed import value_and_grad
from accum.tags import reduce_to, safe_inverse
from accum.trace_record import record_params, traced
from accum.verdict import LOOP_SCOPE, marked


def _local_split(x: jax.Array, n: int) -> jax.Array:
    """A device's rows (b, ...) -> (n, b/n, ...), microbatch i holding local rows
    i, i+n, ...: the same rows as the strided split of the global batch."""
    if x.ndim == 0:
        return jnp.broadcast_to(x, (n,))
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def _device_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's position along the batch axes (row-major), inside shard_map."""
    index = jnp.zeros((), jnp.uint32)
    for axis in axes:
        index = index * lax.axis_size(axis) + lax.axis_index(axis).astype(jnp.uint32)
    return index


def local_accumulate(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    *,
    num_microbatches: int,
    plan: ReductionPlan,
    rng: jax.Array | None,
    grad_shardings: Any,
    accum_dtype: Any,
) -> tuple[jax.Array, dict, Any]:
    """`accumulate_gradients` on the local path (module docstring); same result."""
    axes = plan.batch_axes
    n = num_microbatches
    batch_spec = jax.tree.map(lambda x: P() if x.ndim == 0 else P(axes), batch)

    def body(params, batch, *maybe_rng):
        rng = maybe_rng[0] if maybe_rng else None
        microbatches = jax.tree.map(lambda x: _local_split(x, n), batch)
        # TAG: a varying copy of the weights: the gradient of each device's loss
        # with respect to it stays that device's partial sum (no psum in the loop).
        varying = jax.tree.map(lambda p: lax.pcast(p, axes, to="varying"), params)
        acc0 = jax.tree.map(
            lambda p: jnp.zeros_like(p, accum_dtype if is_floating(p) and accum_dtype else None),
            varying,
        )
        device = _device_index(axes)

        def step(acc, xs):
            index, microbatch = xs
            args = (microbatch,)
            if rng is not None:
                args += (jax.random.fold_in(jax.random.fold_in(rng, index), device),)
            (loss_sum, aux), grads = value_and_grad(loss_fn)(varying, *args)
            if "weight" not in aux:
                raise KeyError("loss_fn's aux must hold 'weight' (the number of counted targets)")
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
            return acc, (loss_sum, aux)

        indices = jnp.arange(n, dtype=jnp.uint32)
        with marked(LOOP_SCOPE, axes, dict(plan.mesh_shape)):
            acc, (loss_sums, auxes) = lax.scan(step, acc0, (indices, microbatches))
        # The step's one reduction of the gradients, loss and aux.
        acc, loss_sum, aux = lax.psum(
            (acc, jnp.sum(loss_sums, 0), jax.tree.map(lambda a: jnp.sum(a, 0), auxes)), axes
        )
        inv = safe_inverse(aux["weight"])
        grads = jax.tree.map(lambda g: g * inv.astype(g.dtype), acc)
        return loss_sum * inv.astype(loss_sum.dtype), aux, grads

    args = (params, batch) if rng is None else (params, batch, rng)
    with traced(plan):
        record_params(params)
        loss, aux, grads = jax.shard_map(
            body,
            in_specs=(P(), batch_spec, P())[: len(args)],
            out_specs=P(),
            axis_names=set(axes),
        )(*args)
    if grad_shardings is None and plan.mode == "explicit":
        # Each gradient back on its parameter's own layout (a batch-sharded
        # parameter was gathered at the shard_map's entry): a slice, no reduction.
        grad_shardings = plan.map(lambda leaf: leaf.param_spec)
    if grad_shardings is not None:
        grads = reduce_to(grads, grad_shardings, plan.mode)
    return loss, aux, grads
