"""Drawing the next token from the last position's logits (sampling.py's settings).

Draws use `jax.random.categorical` with one key per step (the `seed` folded with
the step), one independent draw per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.generate.sampling import Sampling


def _nucleus_mask(sorted_logits_BxK: jax.Array, p: float) -> jax.Array:
    """True for the leading (descending) logits whose cumulative probability first
    reaches `p`, the one that crosses it included."""
    cumulative_BxK = jnp.cumsum(jax.nn.softmax(sorted_logits_BxK, axis=-1), axis=-1)
    # Entries strictly below p are all kept, and so is the next one (it crosses p).
    cutoff_Bx1 = jnp.sum(cumulative_BxK < p, axis=-1, keepdims=True)
    return jnp.arange(sorted_logits_BxK.shape[-1]) <= cutoff_Bx1


def sample(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Token ids [B] (int32) from f32 logits [B, V]."""
    s = sampling
    if s.strategy == "greedy":
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    if s.strategy == "weighted":
        return jax.random.categorical(key, logits_BxV / s.temperature).astype(jnp.int32)
    if s.strategy == "nucleus":
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        # Keep every logit at least the cutoff's (ties with it stay in, as MaxText).
        keep_BxV = _nucleus_mask(sorted_BxV, s.nucleus_p)
        cutoff_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
        kept_BxV = jnp.where(logits_BxV >= cutoff_Bx1, logits_BxV, -jnp.inf)
        return jax.random.categorical(key, kept_BxV / s.temperature).astype(jnp.int32)
    top_BxK, ids_BxK = jax.lax.top_k(logits_BxV, s.top_k)  # topk and composite
    if s.strategy == "composite":
        top_BxK = jnp.where(_nucleus_mask(top_BxK, s.nucleus_p), top_BxK, -jnp.inf)
    pick_B = jax.random.categorical(key, top_BxK / s.temperature)
    return jnp.take_along_axis(ids_BxK, pick_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
