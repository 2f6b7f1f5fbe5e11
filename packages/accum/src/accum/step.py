"""One optimizer step around `accumulate_gradients`, for any optax-style optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from accum.accumulate import accumulate_gradients


def apply_updates(params: Any, updates: Any) -> Any:
    """params + updates, each sum rounded to its parameter's dtype (as
    `optax.apply_updates` does: a bf16 parameter gets an f32 update in one rounding).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> accum.apply_updates({"w": jnp.ones(2)}, {"w": jnp.full(2, 0.5)})["w"].tolist()
    [1.5, 1.5]
    >>> str(accum.apply_updates(jnp.ones(2, jnp.bfloat16), jnp.full(2, 0.5)).dtype)
    'bfloat16'
    """
    return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)


def optimizer_update(optimizer: Any, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    """`(params, opt_state)` after one `optimizer.update` with `grads`.

    The gradients are cast to their parameters' dtypes first (accumulated ones
    are f32 by default; the optimizer state follows the parameters, so the
    step's types stay the same from step to step), then `apply_updates`.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> params, state = accum.optimizer_update(SGD(), jnp.ones(2), (), jnp.ones(2, jnp.bfloat16))
    >>> params.tolist(), str(params.dtype)  # f32 gradients, bf16 parameters
    ([0.5, 0.5], 'bfloat16')
    """
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state


def train_step(
    loss_fn: Callable,
    optimizer: Any,
    params: Any,
    opt_state: Any,
    batch: Any,
    *,
    num_microbatches: int,
    **accum_kwargs: Any,
) -> tuple[Any, Any, jax.Array, dict]:
    """Accumulate gradients over `batch`, then `optimizer.update` and apply.

    `optimizer` follows the optax GradientTransformation protocol
    (`update(grads, state, params) -> (updates, state)`). Keyword arguments go to
    `accumulate_gradients` (plan, schedule, rng, ...). Returns
    `(params, opt_state, loss, aux)`. Call inside `jax.jit`.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> with jax.set_mesh(mesh):
    ...     step = jax.jit(
    ...         lambda w, s, b: accum.train_step(loss_fn, SGD(), w, s, b, num_microbatches=2)
    ...     )
    ...     w, state, loss, aux = step(w, (), batch)
    >>> float(loss), w.tolist()[:2]
    (8.0, [0.5, 0.5])
    """
    loss, aux, grads = accumulate_gradients(
        loss_fn, params, batch, num_microbatches=num_microbatches, **accum_kwargs
    )
    params, opt_state = optimizer_update(optimizer, grads, opt_state, params)
    return params, opt_state, loss, aux
