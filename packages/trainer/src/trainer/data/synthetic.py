"""The synthetic format (`dataset_type=synthetic`): a stream deterministic in seed and
step, its training and eval sources, and every batch's shardings.

A data format (input_pipeline.FORMATS) is a module with `READS` (the data keys it
reads), `train_source(config, global_batch)` and `eval_source(config, global_batch)`.
"""

from __future__ import annotations

import numpy as np

from trainer.config import Config, ConfigError, DataConfig, ModelConfig, TrainingConfig
from trainer.sharding import ShardCtx

BATCH_KEYS = ("inputs", "targets", "positions", "segments", "weights")
TOKENS = ("activation_batch", "activation_length")
READS = ()  # reads no file: every data key is refused
EVAL_STREAM = 1  # the held-out eval stream of the same seed


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


class SyntheticSource:
    """`synthetic_batch`, the whole global batch per step, sliced; no end (num_batches None)."""

    num_batches = None

    def __init__(
        self,
        model: ModelConfig,
        training: TrainingConfig,
        data: DataConfig,
        global_batch: int,
        stream: int = 0,
    ):
        self.model, self.training, self.data = model, training, data
        self.global_batch, self.stream = global_batch, stream
        self._step, self._batch = None, None

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        if self._step != step:
            self._step, self._batch = (
                step,
                synthetic_batch(
                    self.model, self.training, self.data, self.global_batch, step, self.stream
                ),
            )
        return {key: value[start:stop] for key, value in self._batch.items()}

    def describe(self) -> str:
        if self.stream:
            return f"synthetic, held-out stream {self.stream} of seed {self.training.seed}"
        return "data: synthetic (counting sequences, seed-determined)"


def train_source(config: Config, global_batch: int) -> SyntheticSource:
    """The training stream (stream 0)."""
    return SyntheticSource(config.model, config.training, config.data, global_batch)


def eval_source(config: Config, global_batch: int) -> SyntheticSource:
    """The held-out stream EVAL_STREAM of the same seed: it has no end, so eval_steps >= 1."""
    if config.eval_steps <= 0:
        raise ConfigError(
            f"eval_steps={config.eval_steps} means the whole eval set, but the synthetic "
            "eval stream has no end; set eval_steps=N (batches per evaluation)"
        )
    return SyntheticSource(
        config.model, config.training, config.data, global_batch, stream=EVAL_STREAM
    )
