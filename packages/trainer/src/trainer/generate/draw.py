"""Drawing the next token from the last position's logits (sampling.py's settings).

Draws use `jax.random.categorical` with one key per step (the `seed` folded with
the step), one independent draw per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.generate.sampling import USES, Sampling


def _nucleus_mask(sorted_logits_BxK: jax.Array, p: float) -> jax.Array:
    """True for the leading (descending) logits whose cumulative probability first
    reaches `p`, the one that crosses it included."""
    cumulative_BxK = jnp.cumsum(jax.nn.softmax(sorted_logits_BxK, axis=-1), axis=-1)
    # Entries strictly below p are all kept, and so is the next one (it crosses p).
    cutoff_Bx1 = jnp.sum(cumulative_BxK < p, axis=-1, keepdims=True)
    return jnp.arange(sorted_logits_BxK.shape[-1]) <= cutoff_Bx1


def warp(logits_BxV: jax.Array, sampling: Sampling) -> jax.Array:
    """The logits a draw is made from, as transformers' processors leave them: divided
    by the temperature, then -inf outside the top-k (ties with the k-th kept), then
    -inf outside the top-p nucleus of what is left (sampling.py's strategies)."""
    s = sampling
    uses = USES[s.strategy]
    x_BxV = logits_BxV / s.temperature
    if "top_k" in uses and s.top_k < x_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(x_BxV, s.top_k)[0][:, -1:]
        x_BxV = jnp.where(x_BxV < kth_Bx1, -jnp.inf, x_BxV)
    if "nucleus_p" in uses and s.nucleus_p < 1.0:
        sorted_BxV = jnp.sort(x_BxV, axis=-1)[:, ::-1]
        keep_BxV = _nucleus_mask(sorted_BxV, s.nucleus_p)
        cutoff_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
        x_BxV = jnp.where(x_BxV >= cutoff_Bx1, x_BxV, -jnp.inf)
    return x_BxV


def sample(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Token ids [B] (int32) from f32 logits [B, V]."""
    if sampling.strategy == "greedy":
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp(logits_BxV, sampling)).astype(jnp.int32)
