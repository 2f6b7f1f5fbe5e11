"""One device's share of one microbatch on the local paths (accum.local's shard_map
and accum.local_mapped's vmap): the same key, the same loss and gradient, the same
check of what `loss_fn` returns, whichever path maps the devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from accum.batch_collectives import check_loss_types
from accum.seed import value_and_grad


def device_key(rng: jax.Array, index: jax.Array, device: jax.Array) -> jax.Array:
    """The dropout key of one device's rows: `rng` folded with the microbatch
    `index`, then with the device's position along the batch axes."""
    return jax.random.fold_in(jax.random.fold_in(rng, index), device)


def device_grads(
    loss_fn: Callable, params: Any, rows: Any, *key: jax.Array, axes: tuple[str, ...] = ()
) -> tuple:
    """(loss_sum, aux, grads) of `loss_fn(params, rows, *key)` for one device's rows.

    `axes`: the shard_map's batch axes, inside which a loss or weight that no
    longer varies over one was reduced over it in `loss_fn`: refused, one line
    (accum.batch_collectives), before the gradient is divided by the devices.
    """
    (loss_sum, aux), grads = value_and_grad(loss_fn)(params, rows, *key)
    if "weight" not in aux:
        raise KeyError("loss_fn's aux must hold 'weight' (the number of counted targets)")
    if axes:
        check_loss_types(loss_fn, (params, rows, *key), loss_sum, aux["weight"], rows, axes)
    return loss_sum, aux, grads
