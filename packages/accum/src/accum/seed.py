"""Differentiating a reduced-typed loss: through an untagged copy of it.

A loss that depends on a `reduced`-tagged parameter outside any batch-sharded
value (an L2 penalty `0.5 * sum(v * v)`) is itself typed reduced, so
`jax.grad` seeds its backward pass with `reshard(1.0, P(unreduced=...))`: a
replicated constant turned into per-device partial sums, which must be 1.0 on
one device and 0 on the others. In some programs the compiled step instead
all-reduces the bare constant (8.0 on 8 devices) and every gradient comes out
multiplied by the axis size: `jax.grad` with tanh, sigmoid or gelu anywhere in
the model (their derivative holds another `reshard(1.0, P())`), and a seed put
behind an optimization barrier with a squared loss. Plain JAX 0.10.2; the accum
README's known issues has the reproduction.

Resharding the loss onto its untagged spec before differentiating avoids it:
the backward pass starts from a plain replicated 1.0, and the transpose of
that reshard makes the cotangent unreduced (tests/test_reduced_loss_seed.py and
the generated corpus check the gradients). The loss value handed back is the
original one, with its own type.
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


def untagged(loss: jax.Array) -> jax.Array:
    """`loss` resharded onto its partitions without a `reduced` tag; unchanged
    when it has none (an unreduced loss keeps its tag: it is reduced once per
    step, after the loop)."""
    sharding = jax.typeof(loss).sharding
    if not isinstance(sharding, NamedSharding) or not reduced_axes(sharding.spec):
        return loss
    spec = with_unreduced(P(*partitions(sharding.spec)), unreduced_axes(sharding.spec))
    # TAG: differentiate an untagged loss: its seed is a replicated 1.0 (module docstring).
    return jax.reshard(loss, NamedSharding(sharding.mesh, spec))


def value_and_grad(fun: Callable, argnums: int | tuple[int, ...] = 0) -> Callable:
    """`jax.value_and_grad(fun, argnums, has_aux=True)`, differentiating the
    loss through `untagged` (see the module docstring): the same values, also
    for a reduced-typed loss. The loss handed back is `fun`'s own.

    Example:

    >>> f = accum.seed.value_and_grad(lambda w: (jnp.sum(w * w), {"n": 2}))
    >>> (loss, aux), grad = f(jnp.array([1.0, 2.0]))
    >>> float(loss), grad.tolist()
    (5.0, [2.0, 4.0])
    """

    def differentiated(*args: Any) -> Any:
        loss, aux = fun(*args)
        return untagged(loss), (loss, aux)

    def wrapped(*args: Any) -> Any:
        if argnums == 0:
            return _trainable_only(differentiated, *args)
        (_, (loss, aux)), grads = jax.value_and_grad(differentiated, argnums=argnums, has_aux=True)(
            *args
        )
        return (loss, aux), grads

    return wrapped


def _trainable_only(differentiated: Callable, params: Any, *args: Any) -> Any:
    """Differentiate with respect to the floating leaves of `params` only.

    Integer and boolean leaves (a step counter, a mask, an index table kept
    with the weights) are not trainable: `jax.grad` would raise a TypeError on
    them. They are closed over, and their "gradient" is zeros of their own
    dtype, so an optimizer's update leaves them as they are.
    """
    leaves, treedef = jax.tree.flatten(params)
    trainable = [jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in leaves]

    def of_trainable(floats: list, *args: Any) -> Any:
        it = iter(floats)
        full = [next(it) if t else leaf for leaf, t in zip(leaves, trainable, strict=True)]
        return differentiated(jax.tree.unflatten(treedef, full), *args)

    floats = [leaf for leaf, t in zip(leaves, trainable, strict=True) if t]
    (_, (loss, aux)), grads = jax.value_and_grad(of_trainable, has_aux=True)(floats, *args)
    it = iter(grads)
    full = [
        next(it) if t else jnp.zeros_like(leaf) for leaf, t in zip(leaves, trainable, strict=True)
    ]
    return (loss, aux), jax.tree.unflatten(treedef, full)
