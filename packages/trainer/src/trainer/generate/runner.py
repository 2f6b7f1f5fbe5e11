"""`generate`: prompts of any lengths in one batch, through the jitted prefill and
decode loop (decode.py), on the one device the parameters live on."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from trainer.config import Config
from trainer.generate import decode
from trainer.generate.sampling import GREEDY, Sampling


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
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    # No capacity cap: each token is routed as the full forward routes it, never
    # dropped for sharing a batch. Where the weights came from compiles nothing, and
    # a LoRA run's weights arrive merged (W + alpha / r A B): no adapters to run.
    model_config = dataclasses.replace(
        config.model, capacity_factor=0.0, hf_model_path="", lora_rank=0
    )
    mesh = _mesh_of(params)
    tokens_BxP, start_B = _left_padded(prompts)
    shapes = decode.Shapes(len(prompts), tokens_BxP.shape[1], max_new_tokens)
    prefill, run = decode.compiled(model_config, config.parallelism, mesh, shapes, sampling)
    eos_E = np.asarray([int(e) for e in eos_ids] or [decode.NO_TOKEN], np.int32)
    with jax.set_mesh(mesh):
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        tokens_BxP, start_B, eos_E = jax.device_put((tokens_BxP, start_B, eos_E), replicated)
        key = jax.device_put(jax.random.key(seed), replicated)
        logits_BxV, cache = prefill(params["params"], params["router"], tokens_BxP, start_B)
        out_BxN = run(params["params"], params["router"], cache, logits_BxV, start_B, key, eos_E)
    return [[int(t) for t in row if t != decode.NO_TOKEN] for row in np.asarray(out_BxN)]
