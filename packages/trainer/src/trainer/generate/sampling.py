"""The next token from the last position's logits, under MaxText's decode keys.

`decode_sampling_strategy` (MaxText's values and meanings, inference_utils.sampling):

- greedy: the argmax (temperature, top_k and nucleus_p unused);
- weighted: a draw from softmax(logits / temperature);
- topk: a draw among the `decode_sampling_top_k` largest logits, / temperature;
- nucleus: a draw among the largest logits whose probabilities (softmax of the
  logits before the temperature, as MaxText) first reach `decode_sampling_nucleus_p`,
  the token crossing it included, / temperature;
- composite: top-k, then the nucleus among those k (their own softmax), then the
  temperature.

Draws use `jax.random.categorical` with one key per step (the run's `seed` folded
with the step), one independent draw per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trainer.config import ConfigError

STRATEGIES = ("greedy", "weighted", "topk", "nucleus", "composite")
# Which of the three numbers each strategy reads.
USES = {
    "greedy": (),
    "weighted": ("temperature",),
    "topk": ("temperature", "top_k"),
    "nucleus": ("temperature", "nucleus_p"),
    "composite": ("temperature", "top_k", "nucleus_p"),
}
KEY_OF = {
    "temperature": "decode_sampling_temperature",
    "top_k": "decode_sampling_top_k",
    "nucleus_p": "decode_sampling_nucleus_p",
}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked (hashable: the decode loop compiles per value)."""

    strategy: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    nucleus_p: float = -1.0


def check(sampling: Sampling, vocab_size: int) -> list[str]:
    """ConfigError naming the key whose value the strategy cannot use; returns notes
    for keys set away from their defaults that the strategy ignores."""
    s = sampling
    if s.strategy not in STRATEGIES:
        raise ConfigError(
            f"decode_sampling_strategy={s.strategy!r} is not one of {', '.join(STRATEGIES)}"
        )
    used = USES[s.strategy]
    if "temperature" in used and not s.temperature > 0:
        raise ConfigError(
            f"decode_sampling_temperature={s.temperature} must be > 0 with "
            f"decode_sampling_strategy={s.strategy}"
        )
    if "top_k" in used and not 1 <= s.top_k <= vocab_size:
        raise ConfigError(
            f"decode_sampling_top_k={s.top_k} must be in [1, {vocab_size}] (the vocabulary) "
            f"with decode_sampling_strategy={s.strategy}"
        )
    if "nucleus_p" in used and not 0 < s.nucleus_p <= 1:
        raise ConfigError(
            f"decode_sampling_nucleus_p={s.nucleus_p} must be in (0, 1] with "
            f"decode_sampling_strategy={s.strategy}"
        )
    default = Sampling()
    return [
        f"{KEY_OF[name]}={getattr(s, name)} has no effect with "
        f"decode_sampling_strategy={s.strategy}"
        for name in KEY_OF
        if name not in used and getattr(s, name) != getattr(default, name)
    ]


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
