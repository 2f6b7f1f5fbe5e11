"""Batches: the synthetic stream (deterministic in seed and step) and their shardings."""

from __future__ import annotations

import numpy as np

from trainer.config import DataConfig, ModelConfig, TrainingConfig
from trainer.sharding import ShardCtx

BATCH_KEYS = ("inputs", "targets", "positions", "segments", "weights")
TOKENS = ("activation_batch", "activation_length")


def synthetic_batch(
    model: ModelConfig,
    training: TrainingConfig,
    data: DataConfig,
    batch_size: int,
    step: int,
    stream: int = 0,
) -> dict[str, np.ndarray]:
    """Learnable synthetic text: each row counts up from a random start by a random stride.

    The next token is a function of the current one and the row's stride, so
    the loss falls quickly and a broken train step shows. Deterministic in
    (seed, step): a resumed run sees the same stream. `stream` > 0 draws another,
    independent stream from the same seed (the held-out eval stream); stream 0 is
    the training stream, unchanged. Reads vocab_size, seed and max_target_length.
    """
    seed = training.seed
    rng = np.random.default_rng([seed, step, stream] if stream else [seed, step])
    length, vocab = data.max_target_length, model.vocab_size
    start_Bx1 = rng.integers(0, vocab, size=(batch_size, 1))
    stride_Bx1 = rng.integers(1, 4, size=(batch_size, 1))
    # (B, S + 1): inputs and targets are its two shifted views.
    sequence = (start_Bx1 + stride_Bx1 * np.arange(length + 1)) % vocab
    ones = np.ones((batch_size, length), np.int32)
    return {
        "inputs": sequence[:, :-1].astype(np.int32),
        "targets": sequence[:, 1:].astype(np.int32),
        "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (batch_size, length)),
        "segments": ones,
        "weights": ones.astype(np.float32),
    }


def batch_shardings(ctx: ShardCtx, batch_size: int, length: int) -> dict:
    """Every batch leaf is (batch, length), sharded over the batch and sequence axes."""
    sharding = ctx.sharding(TOKENS, (batch_size, length))
    return {key: sharding for key in BATCH_KEYS}
