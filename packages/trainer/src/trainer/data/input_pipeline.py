"""Where batches come from (`dataset_type`) and how a process puts its rows on the mesh.

A source answers `rows(step, start, stop)`: rows [start, stop) of the global
batch of `step`, deterministic in (seed, step). `put_rows` asks only for the
rows this process's devices hold, so every process builds only its own share.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np

from trainer import data as data_lib
from trainer.config import Config, ConfigError, DataConfig, ModelConfig, TrainingConfig
from trainer.sharding import ShardCtx


class Source(Protocol):
    global_batch: int

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]: ...

    def describe(self) -> str: ...


class SyntheticSource:
    """`data.synthetic_batch`, the whole global batch per step, sliced."""

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
                data_lib.synthetic_batch(
                    self.model, self.training, self.data, self.global_batch, step, self.stream
                ),
            )
        return {key: value[start:stop] for key, value in self._batch.items()}

    def describe(self) -> str:
        return "data: synthetic (counting sequences, seed-determined)"


# The data keys and the dataset_type that reads each (first: the one to suggest); set
# under another dataset_type, a key would be silently ignored, so it is refused.
DATA_KEYS = {
    "dataset_path": ("text",),
    "eval_dataset_path": ("text",),
    "tokenizer_path": ("text", "hf"),
    "hf_path": ("hf",),
    "hf_train_files": ("hf",),
    "hf_eval_files": ("hf",),
}


def check_data_keys(config: Config) -> None:
    """Refuse a data key that the configured dataset_type would not read (the keys are
    the data group's but eval_dataset_path, the evaluation group's: takes the Config)."""
    for key, readers in DATA_KEYS.items():
        value = getattr(config, key)
        if value and config.dataset_type not in readers:
            purpose = "evaluate on" if "eval" in key else "train on"
            raise ConfigError(
                f"{key}={value!r} is set but dataset_type={config.dataset_type}; "
                f"add dataset_type={readers[0]} to {purpose} it"
            )


def make_source(config: Config, global_batch: int) -> Source:
    """Open the configured dataset; every input problem is a ConfigError, before compiling.

    Takes the Config: the sources read the model, training, data and evaluation groups."""
    check_data_keys(config)
    model, training, data = config.model, config.training, config.data
    from trainer.data import sft_data  # here, as the sources below: synthetic runs read no files

    sft_data.check_keys(data)
    if data.use_sft:
        return sft_data.make_sft_source(model, training, data, config.evaluation, global_batch)
    if data.dataset_type == "text":
        # deferred: only the configured reader's dependencies load (pyarrow, jinja2)
        from trainer.data import text_data

        return text_data.make_text_source(model, training, data, global_batch)
    if data.dataset_type == "hf":
        # deferred: only the configured reader's dependencies load (pyarrow, jinja2)
        from trainer.data import hf_data

        return hf_data.make_hf_source(model, training, data, config.evaluation, global_batch)
    return SyntheticSource(model, training, data, global_batch)


def put_rows(source: Source, step: int, ctx: ShardCtx, length: int) -> dict[str, jax.Array]:
    """The global batch of `step` on the mesh, each process building only its rows."""
    batch = source.global_batch
    shardings = data_lib.batch_shardings(ctx, batch, length)
    cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def block(key: str, index: tuple[slice, ...]) -> np.ndarray:
        start, stop, _ = index[0].indices(batch)
        if (start, stop) not in cache:
            cache[(start, stop)] = source.rows(step, start, stop)
        return cache[(start, stop)][key][(slice(None), *index[1:])]

    return {
        key: jax.make_array_from_callback(
            (batch, length), sharding, lambda index, key=key: block(key, index)
        )
        for key, sharding in shardings.items()
    }
