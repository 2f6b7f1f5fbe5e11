"""Where batches come from (the data format) and how a process puts its rows on the mesh.

A source answers `rows(step, start, stop)`: rows [start, stop) of the global
batch of `step`, deterministic in (seed, step). `put_rows` asks only for the
rows this process's devices hold, so every process builds only its own share.

Each format is one module (FORMATS) with the same three names: `READS`, the data keys
it reads; `train_source(config, global_batch)`, the training stream; and
`eval_source(config, global_batch)`, the eval set's rows in order (`num_batches` in one
pass, None for a stream with no end). Every input problem is a ConfigError raised
before anything compiles. Adding a format: one module and one row of FORMATS.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Protocol

import jax
import numpy as np

from trainer import data as data_lib
from trainer.config import Config, ConfigError
from trainer.data import hf_data, sft_data, synthetic, text_data
from trainer.sharding import ShardCtx


class Source(Protocol):
    global_batch: int

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]: ...

    def describe(self) -> str: ...


class EvalSource(Source, Protocol):
    num_batches: int | None  # batches in one pass over the set; None: no end


# (dataset_type, use_sft) -> the format module that reads it: the one place either key
# is read to choose where batches come from (the first row reading a key is the one an
# error suggests).
FORMATS: dict[tuple[str, bool], ModuleType] = {
    ("synthetic", False): synthetic,
    ("text", False): text_data,
    ("hf", False): hf_data,
    ("hf", True): sft_data,
}


def _refuse_unread_key(config: Config, reads: tuple[str, ...]) -> None:
    """A data key set (not its default) that the chosen format does not read would be
    silently ignored: refuse it, naming the choice (FORMATS' first row reading it) that would."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    now = {"dataset_type": config.dataset_type, "use_sft": config.use_sft}
    for (dataset_type, use_sft), format_ in FORMATS.items():
        wanted = {"dataset_type": dataset_type, "use_sft": use_sft}
        for key in format_.READS:
            value = getattr(config, key)
            if key in reads or value == defaults[key]:
                continue
            differ = [name for name in now if now[name] != wanted[name]]
            purpose = ""
            if key.endswith(("_path", "_files")):
                purpose = " to evaluate on it" if "eval" in key else " to train on it"
            raise ConfigError(
                f"{key}={_shown(value)} is set but "
                f"{' '.join(f'{name}={_shown(now[name], str)}' for name in differ)}; add "
                f"{' '.join(f'{name}={_shown(wanted[name], str)}' for name in differ)}{purpose}"
            )


def _shown(value, text=repr) -> str:
    """A key's value as the command line writes it (booleans lower case)."""
    return str(value).lower() if isinstance(value, bool) else text(value)


def data_format(config: Config) -> ModuleType:
    """The module reading the configured data (FORMATS), its keys checked: a key it does
    not read is refused; cheap, nothing read."""
    format_ = FORMATS.get((config.dataset_type, config.use_sft))
    if format_ is None:  # use_sft under a dataset_type with no SFT reader
        types = [t for t, sft in FORMATS if sft == config.use_sft]
        raise ConfigError(
            f"{sft_data.NEEDS} but dataset_type={config.dataset_type}; add dataset_type={types[0]}"
        )
    _refuse_unread_key(config, format_.READS)
    return format_


def make_source(config: Config, global_batch: int) -> Source:
    """Open the configured dataset's training stream; every input problem is a
    ConfigError, before compiling. Takes the Config: a format reads the model, training,
    data and evaluation groups."""
    return data_format(config).train_source(config, global_batch)


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
