"""One optimizer step around `accumulate_gradients`, for any optax-style optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from accum.accumulate import accumulate_gradients


def apply_updates(params: Any, updates: Any) -> Any:
    """params + updates, each update cast to its parameter's dtype (as optax does)."""
    return jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)


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
    `accumulate_gradients` (mode, defer_reduction, rng, ...). Returns
    `(params, opt_state, loss, aux)`. Call inside `jax.jit`.
    """
    loss, aux, grads = accumulate_gradients(
        loss_fn, params, batch, num_microbatches=num_microbatches, **accum_kwargs
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state, loss, aux
