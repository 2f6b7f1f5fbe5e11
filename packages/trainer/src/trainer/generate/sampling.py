"""The next token from the last position's logits: MaxText's decode keys, computed in
transformers' order and with its defaults.

`decode_sampling_strategy` names which filters run; each runs as transformers' logits
processor of the same job, in the order `generate` builds them: the temperature
(TemperatureLogitsWarper), then top-k (TopKLogitsWarper: the k largest, ties with
the k-th kept), then top-p (TopPLogitsWarper: the largest tokens whose probability
after the filters before it first reaches p, the token crossing it included):

- greedy: the argmax (temperature, top_k and nucleus_p unused);
- weighted: a draw from softmax(logits / temperature);
- topk: temperature, then top-k;
- nucleus: temperature, then top-p (`decode_sampling_nucleus_p`);
- composite: temperature, then top-k, then top-p (transformers' do_sample).

Defaults are the checkpoint's generation_config.json (`do_sample`: composite, else
greedy; its `temperature`, `top_k`, `top_p`), else transformers' (1.0, 50, 1.0).

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
# generation_config.json's name of each number, and transformers' default for it
# (GenerationConfig leaves them unset; generate then samples with these).
HF_KEY = {"temperature": "temperature", "top_k": "top_k", "nucleus_p": "top_p"}
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "nucleus_p": 1.0}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked (hashable: the decode loop compiles per value)."""

    strategy: str = "greedy"
    temperature: float = HF_DEFAULTS["temperature"]
    top_k: int = HF_DEFAULTS["top_k"]
    nucleus_p: float = HF_DEFAULTS["nucleus_p"]


GREEDY = Sampling()  # transformers' default (do_sample false)


def choose_sampling(given: dict, generation: dict) -> Sampling:
    """The Sampling of the keys `given` (strategy, temperature, top_k, nucleus_p, as
    parsed), the rest from `generation` (a checkpoint's generation_config.json: its
    do_sample picks composite over greedy; its temperature, top_k, top_p), the rest
    transformers' defaults."""
    numbers = {}
    for name, hf_key in HF_KEY.items():
        if name in given:
            numbers[name] = given[name]
        elif generation.get(hf_key) is not None:
            numbers[name] = generation[hf_key]
        else:
            numbers[name] = HF_DEFAULTS[name]
    sampled = "composite" if generation.get("do_sample") else "greedy"
    return Sampling(given.get("strategy", sampled), **numbers)


def describe(s: Sampling) -> str:
    """The strategy and the numbers it uses, for the startup line."""
    used = USES.get(s.strategy, ())
    numbers = ", ".join(f"{HF_KEY[name]} {getattr(s, name):g}" for name in used)
    return f"{s.strategy} ({numbers})" if numbers else s.strategy


def check(sampling: Sampling, vocab_size: int, given: tuple[str, ...] | None = None) -> list[str]:
    """ConfigError naming the key whose value the strategy cannot use; returns notes
    for keys `given` on the command line (None: those away from their defaults) that
    the strategy ignores."""
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
    if given is None:
        given = tuple(n for n in KEY_OF if getattr(s, n) != getattr(default, n))
    return [
        f"{KEY_OF[name]}={getattr(s, name)} has no effect with "
        f"decode_sampling_strategy={s.strategy}"
        for name in KEY_OF
        if name not in used and name in given
    ]
