"""Sampling from a trained or imported model: the `generate` console script and its API.

`generate(config, params, prompts, ...)` continues each prompt (token ids) by up to
`max_new_tokens` tokens over an MLA KV cache (kv_cache.py: the compressed latent and
the rotary key per token, attention in DeepSeek's absorbed form), one jitted prefill
and one jitted decode loop (decode.py), picking tokens under MaxText's
`decode_sampling_*` keys (sampling.py). Several prompts run as one batch, left-padded,
each row with its own positions; a row ends at its eos. cli.py is the command line
(`generate hf_model_path=DIR prompt="..."`, docs/finetune.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from trainer.config import Config
from trainer.generate.sampling import STRATEGIES, Sampling

__all__ = ["GREEDY", "STRATEGIES", "Sampling", "generate"]

GREEDY = Sampling()


def _mesh_of(params: dict):
    meshes = {leaf.sharding.mesh for leaf in jax.tree.leaves(params)}
    mesh = meshes.pop()
    if meshes or mesh.size != 1:
        raise ValueError(
            f"generate runs on one device; the parameters live on {mesh.size} "
            "(load them with trainer.hf.load, or generate.cli's loaders)"
        )
    return mesh


def _left_padded(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, P] right-aligned, first real slot per row [B]); the padding is id 0,
    which no real token attends to."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    tokens_BxP = np.zeros((len(prompts), length), np.int32)
    start_B = np.zeros(len(prompts), np.int32)
    for row, prompt in enumerate(prompts):
        start_B[row] = length - len(prompt)
        tokens_BxP[row, start_B[row] :] = prompt
    return tokens_BxP, start_B


def generate(
    config: Config,
    params: dict[str, dict],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
) -> list[list[int]]:
    """The new token ids of each prompt: up to `max_new_tokens`, ending with the first
    of `eos_ids` where one is drawn. `params` is {"params", "router"} on one device
    (`trainer.hf.load`); `prompts` are token id lists of any lengths (one batch).

    Greedy (the default) is the argmax of the full forward at every step. The MoE
    runs without a capacity cap (`capacity_factor` is set to 0 here): each token is
    routed exactly as the full forward routes it, never dropped.
    """
    from trainer.generate import decode  # defers jax-heavy model code to first use

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    config = dataclasses.replace(config, capacity_factor=0.0)
    mesh = _mesh_of(params)
    tokens_BxP, start_B = _left_padded(prompts)
    shapes = decode.Shapes(len(prompts), tokens_BxP.shape[1], max_new_tokens)
    prefill, run = decode.compiled(config, mesh, shapes, sampling, tuple(int(e) for e in eos_ids))
    with jax.set_mesh(mesh):
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        tokens_BxP, start_B = jax.device_put((tokens_BxP, start_B), replicated)
        key = jax.device_put(jax.random.key(seed), replicated)
        logits_BxV, cache = prefill(params["params"], params["router"], tokens_BxP, start_B)
        out_BxN = run(params["params"], params["router"], cache, logits_BxV, start_B, key)
    return [[int(t) for t in row if t != decode.NO_TOKEN] for row in np.asarray(out_BxN)]
