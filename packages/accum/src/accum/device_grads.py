"""One device's share of one microbatch on the local paths (accum.local's shard_map
and accum.local_mapped's vmap): the same key, the same loss and gradient, the same
check of what `loss_fn` returns, whichever path maps the devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from accum.seed import value_and_grad


def device_key(rng: jax.Array, index: jax.Array, device: jax.Array) -> jax.Array:
    """The dropout key of one device's rows: `rng` folded with the microbatch
    `index`, then with the device's position along the batch axes."""
    return jax.random.fold_in(jax.random.fold_in(rng, index), device)


def device_grads(loss_fn: Callable, params: Any, rows: Any, *key: jax.Array) -> tuple:
    """(loss_sum, aux, grads) of `loss_fn(params, rows, *key)` for one device's rows."""
    (loss_sum, aux), grads = value_and_grad(loss_fn)(params, rows, *key)
    if "weight" not in aux:
        raise KeyError("loss_fn's aux must hold 'weight' (the number of counted targets)")
    return loss_sum, aux, grads
