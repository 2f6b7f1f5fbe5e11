"""The eval set: which batches an evaluation reads, and every check on the eval keys.

Every evaluation reads the same batches — the first `eval_steps` of the eval
set, in order — so eval losses at different steps are comparable.

- `dataset_type=text`: the files under `eval_dataset_path`, tokenized and packed
  exactly as the training files are (same tokenizer, `max_target_length`,
  segments), read in file order without shuffling; rows past the end of the set
  are padding (weight 0), so no row is counted twice. `eval_steps <= 0` reads the
  whole set once; a larger `eval_steps` than the set holds is capped to it.
- `dataset_type=hf`: the parquet files `hf_eval_files`, column
  `eval_data_columns` (unset: `train_data_columns`), read and packed as the
  training files are (hf_data.py), then as the text eval set.
- `use_sft=true`: the examples of `hf_eval_files` (.jsonl / .parquet), encoded,
  masked, truncated and packed as the training ones (sft_data.py), then as the text
  eval set: the eval loss is the mean over the counted tokens of the whole set.
- `dataset_type=synthetic`: the same counting generator on another stream of the
  same seed (`data.synthetic_batch(..., stream=EVAL_STREAM)`): held out from
  every training batch, and `eval_steps` must be >= 1 (the stream has no end).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from trainer.config import (
    Config,
    ConfigError,
    DataConfig,
    EvaluationConfig,
    ParallelismConfig,
)
from trainer.config.validate import batch_shard_count
from trainer.data import eval_schedule, hf_data, sft_data, text_data
from trainer.data.input_pipeline import Source, SyntheticSource

EVAL_STREAM = 1


def eval_batch_size(
    parallelism: ParallelismConfig,
    data: DataConfig,
    evaluation: EvaluationConfig,
    num_devices: int,
    sizes: dict[str, int],
) -> int:
    """Sequences per eval batch: eval_per_device_batch_size (0: per_device_batch_size)
    x devices; a whole number that splits over the batch shards, as a microbatch must."""
    per_device = evaluation.eval_per_device_batch_size
    if per_device < 0:
        raise ConfigError(
            f"eval_per_device_batch_size={per_device} must be >= 0 (0: per_device_batch_size)"
        )
    key = "eval_per_device_batch_size" if per_device else "per_device_batch_size"
    per_device = per_device or data.per_device_batch_size
    total = per_device * num_devices
    if total < 1 or total != int(total):
        raise ConfigError(
            f"{key}={per_device} x {num_devices} devices = {total} is not a whole, positive "
            "number of sequences per eval batch"
        )
    shards = batch_shard_count(parallelism, sizes)
    if int(total) % shards:
        raise ConfigError(
            f"eval batch of {int(total)} sequences ({key}={per_device} x {num_devices} devices) "
            f"does not split over the {shards} batch shards; set eval_per_device_batch_size so "
            f"that it does"
        )
    return int(total)


class TextEvalSource:
    """The packed eval rows in order; row i of eval batch b is row b * batch + i of the set."""

    def __init__(self, text: text_data.PackedText, global_batch: int, kind: str = "text"):
        self.text, self.global_batch, self.kind = text, global_batch, kind
        self._padding = {
            key: np.zeros(text.packed.length, np.float32 if key == "weights" else np.int32)
            for key in text_data.KEYS
        }

    @property
    def num_batches(self) -> int:
        """Batches in one pass over the set (the last one padded)."""
        return math.ceil(len(self.text.packed) / self.global_batch)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        base, packed = step * self.global_batch, self.text.packed
        examples = [
            packed[base + r] if base + r < len(packed) else self._padding
            for r in range(start, stop)
        ]
        return {key: np.stack([e[key] for e in examples]) for key in text_data.KEYS}

    def describe(self) -> str:
        return f"{self.kind}, {self.text.describe()}"


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """What one evaluation reads: `steps` batches of `source` (batch index 0..steps-1)."""

    source: Source
    steps: int
    batch_size: int
    note: str  # where the batches come from, for the startup line


def make_eval_set(config: Config, num_devices: int, sizes: dict[str, int]) -> EvalSet | None:
    """Check the eval keys and open the eval data (before anything compiles); None when off.

    Takes the Config: the eval set reads the model, parallelism, training, data and
    evaluation groups."""
    model, training, data = config.model, config.training, config.data
    evaluation = config.evaluation
    if not eval_schedule.enabled(evaluation):
        return None
    batch = eval_batch_size(config.parallelism, data, evaluation, num_devices, sizes)
    if data.dataset_type == "synthetic":
        if evaluation.eval_steps <= 0:
            raise ConfigError(
                f"eval_steps={evaluation.eval_steps} means the whole eval set, but the synthetic "
                "eval stream has no end; set eval_steps=N (batches per evaluation)"
            )
        source = SyntheticSource(model, training, data, batch, stream=EVAL_STREAM)
        note = f"synthetic, held-out stream {EVAL_STREAM} of seed {training.seed}"
        return EvalSet(source, evaluation.eval_steps, batch, note)
    if data.use_sft:
        text = sft_data.load_eval(model, data, evaluation)
        source = TextEvalSource(text, batch, "sft")
    elif data.dataset_type == "hf":
        column = hf_data.open_column(
            data, evaluation, "hf_eval_files", hf_data.eval_columns_key(data)
        )
        text = hf_data.load_packed(model, data, column)
        source = TextEvalSource(text, batch, hf_data.describe_kind(column))
    else:
        if not evaluation.eval_dataset_path:
            raise ConfigError(
                f"eval_interval={evaluation.eval_interval} with dataset_type=text needs "
                "eval_dataset_path=DIR_OR_GLOB (.txt / .jsonl files held out from training)"
            )
        text = text_data.load_packed(
            model, data, evaluation.eval_dataset_path, key="eval_dataset_path"
        )
        source = TextEvalSource(text, batch)
    steps = source.num_batches
    note = source.describe()
    if 0 < evaluation.eval_steps < steps:
        steps = evaluation.eval_steps
    elif evaluation.eval_steps > steps:
        note += f"; eval_steps={evaluation.eval_steps} capped to the set's {steps} batches"
    return EvalSet(source, steps, batch, note)
