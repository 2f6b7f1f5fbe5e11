"""Differentiating a loss with a seed the compiler cannot merge with another 1.0.

`jax.grad` seeds the backward pass with the constant 1.0, resharded onto the
loss's cotangent type. A loss that depends on a `reduced`-tagged parameter
outside any batch-sharded value (an L2 penalty `0.5 * sum(v * v)`) is itself
typed reduced, so its seed is `reshard(1.0, P(unreduced=...))`: one device
holds the 1.0, the others 0. Where the program also holds
`reshard(1.0, P())` (explicit mode's derivative of tanh, sigmoid and gelu,
`1 - y**2`), the compiler merges the two identical constants and the
unreduced one is then read as 1.0 on every device: every gradient comes out
multiplied by the axis size (8x on 8 devices; plain JAX 0.10.2 and 0.12, see
the accum README's known issues). An optimization barrier makes the seed a
value no constant can be merged with; it costs one scalar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pspec_tags import partitions, reduced_axes, unreduced_axes, with_reduced, with_unreduced


def cotangent_like(seed: jax.Array, primal: jax.Array) -> jax.Array:
    """`seed` broadcast to the cotangent type of `primal`.

    Cotangents swap the tags: an unreduced loss (`pspec_tags.unreduced_sum`)
    takes a reduced cotangent and vice versa; partitions are kept.
    """
    seed = seed.astype(primal.dtype)
    sharding = jax.typeof(primal).sharding
    if not isinstance(sharding, NamedSharding):
        return jnp.broadcast_to(seed, primal.shape)
    spec = sharding.spec
    target = with_reduced(P(*partitions(spec)), unreduced_axes(spec))
    target = with_unreduced(target, reduced_axes(spec))
    # TAG: the seed takes the loss's cotangent type (tags swapped), as jax.grad's would.
    return lax.broadcast_in_dim(
        seed, primal.shape, (), out_sharding=NamedSharding(sharding.mesh, target)
    )


def value_and_grad(fun: Callable, argnums: int | tuple[int, ...] = 0) -> Callable:
    """`jax.value_and_grad(fun, argnums, has_aux=True)` seeded with a 1.0 behind an
    optimization barrier (see the module docstring): the same values, also
    for a reduced-typed loss in a program holding another 1.0.

    Example:

    >>> f = accum.seed.value_and_grad(lambda w: (jnp.sum(w * w), {"n": 2}))
    >>> (loss, aux), grad = f(jnp.array([1.0, 2.0]))
    >>> float(loss), grad.tolist()
    (5.0, [2.0, 4.0])
    """

    def wrapped(*args: Any) -> Any:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        primals = [args[i] for i in nums]

        def of_primals(*diff):
            full = list(args)
            for i, value in zip(nums, diff, strict=True):
                full[i] = value
            return fun(*full)

        loss, vjp, aux = jax.vjp(of_primals, *primals, has_aux=True)
        seed = lax.optimization_barrier(jnp.ones((), loss.dtype))
        grads = vjp(cotangent_like(seed, loss))
        return (loss, aux), grads[0] if isinstance(argnums, int) else grads

    return wrapped
