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

Each format's `eval_source` (input_pipeline.FORMATS) opens its set; here only what
every format shares: the batch size, how many batches an evaluation reads, the note.
"""

from __future__ import annotations

import dataclasses

from trainer.config import (
    Config,
    ConfigError,
    DataConfig,
    EvaluationConfig,
    ParallelismConfig,
)
from trainer.config.pipeline import pipeline_microbatches, stage_count
from trainer.config.validate import batch_shard_count
from trainer.data import eval_schedule, input_pipeline
from trainer.data.input_pipeline import EvalSource


def eval_batch_size(
    parallelism: ParallelismConfig,
    data: DataConfig,
    evaluation: EvaluationConfig,
    num_devices: int,
    sizes: dict[str, int],
    microbatches: int = 1,
) -> int:
    """Sequences per eval batch: eval_per_device_batch_size (0: per_device_batch_size)
    x devices; a whole number that splits over the batch shards, as a microbatch must,
    into each of `microbatches` (pipeline stages run an eval batch as the pipeline's
    microbatches, model/pipeline.py's run_pipeline)."""
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
    if int(total) % (shards * microbatches):
        into = f"{microbatches} pipeline microbatches x " if microbatches > 1 else ""
        raise ConfigError(
            f"eval batch of {int(total)} sequences ({key}={per_device} x {num_devices} devices) "
            f"does not split over the {into}{shards} batch shards; set "
            "eval_per_device_batch_size so that it does"
        )
    return int(total)


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """What one evaluation reads: `steps` batches of `source` (batch index 0..steps-1)."""

    source: EvalSource
    steps: int
    batch_size: int
    note: str  # where the batches come from, for the startup line


def make_eval_set(config: Config, num_devices: int, sizes: dict[str, int]) -> EvalSet | None:
    """Check the eval keys and open the eval data (before anything compiles); None when off.

    Takes the Config: the eval set reads the model, parallelism, training, data and
    evaluation groups."""
    evaluation = config.evaluation
    if not eval_schedule.enabled(evaluation):
        return None
    staged = stage_count(config) > 1
    microbatches = pipeline_microbatches(config, config.accumulation) if staged else 1
    batch = eval_batch_size(
        config.parallelism, config.data, evaluation, num_devices, sizes, microbatches
    )
    source = input_pipeline.choose_format(config).eval_source(config, batch)
    steps, note = source.num_batches, source.describe()
    if steps is None:  # a stream with no end: eval_source checked eval_steps >= 1
        return EvalSet(source, evaluation.eval_steps, batch, note)
    if 0 < evaluation.eval_steps < steps:
        steps = evaluation.eval_steps
    elif evaluation.eval_steps > steps:
        note += f"; eval_steps={evaluation.eval_steps} capped to the set's {steps} batches"
    return EvalSet(source, steps, batch, note)
