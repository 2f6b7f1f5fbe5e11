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

This module holds the settings and their checks (no jax.numpy: the command line checks
them before any backend starts); draw.py draws.
"""

from __future__ import annotations

import dataclasses

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


GREEDY = Sampling()  # MaxText's default


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
