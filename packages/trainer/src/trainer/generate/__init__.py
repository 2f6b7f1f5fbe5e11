"""Sampling from a trained or imported model: the `generate` console script and its API.

`generate(config, params, prompts, ...)` continues each prompt (token ids) by up to
`max_new_tokens` tokens over an MLA KV cache (kv_cache.py: the compressed latent and
the rotary key per token, attention in DeepSeek's absorbed form), one jitted prefill
and one jitted decode loop (decode.py, runner.py), picking tokens under MaxText's
`decode_sampling_*` keys (sampling.py, draw.py). Several prompts run as one batch,
left-padded, each row with its own positions; a row ends at its eos. cli.py is the
command line (`generate hf_model_path=DIR prompt="..."`, docs/finetune.md).

`generate` loads on first use, so the command line checks its arguments before the
model code loads or a backend starts.
"""

from __future__ import annotations

from typing import Any

from trainer.generate.sampling import GREEDY, STRATEGIES, Sampling

__all__ = ["GREEDY", "STRATEGIES", "Sampling", "generate"]


def __getattr__(name: str) -> Any:
    if name != "generate":
        raise AttributeError(f"module 'trainer.generate' has no attribute {name!r}")
    from trainer.generate.runner import generate  # the model code loads here

    globals()["generate"] = generate
    return generate
