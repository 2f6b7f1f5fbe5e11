"""Config: every key as a flat attribute, each group as a view (`config.data`)."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

from trainer.config.model_keys import ModelConfig
from trainer.config.run_keys import (
    AccumulationConfig,
    CheckpointingConfig,
    DataConfig,
    EvaluationConfig,
    OutputConfig,
    ParallelismConfig,
    TrainingConfig,
)

# Group name -> its dataclass, in the order docs/config.md lists them.
GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "training": TrainingConfig,
    "accumulation": AccumulationConfig,
    "data": DataConfig,
    "evaluation": EvaluationConfig,
    "checkpointing": CheckpointingConfig,
    "output": OutputConfig,
}


Group = typing.TypeVar("Group")


class _GroupView(typing.Generic[Group]):
    """`config.<group>`: the config's keys of one group, as that group's dataclass.
    (A class attribute without an annotation: no dataclass field.)"""

    def __init__(self, group: type[Group]):
        self.group = group

    def __get__(self, config: Any, owner: type | None = None) -> Group:
        return self.group(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(self.group)}
        )


# Bases last to first: dataclass fields follow the reversed MRO, so keys keep the
# group order of GROUPS.
@dataclasses.dataclass(frozen=True)
class Config(
    OutputConfig,
    CheckpointingConfig,
    EvaluationConfig,
    DataConfig,
    AccumulationConfig,
    TrainingConfig,
    ParallelismConfig,
    ModelConfig,
):
    """Everything a run needs. Build with `make_config(overrides)`, never by hand.

    Every key is a flat attribute (`config.steps`); `config.<group>` (model,
    parallelism, training, accumulation, data, evaluation, checkpointing, output)
    is one group's keys as its own frozen dataclass, for a module that reads only those.
    """

    model = _GroupView(ModelConfig)
    parallelism = _GroupView(ParallelismConfig)
    training = _GroupView(TrainingConfig)
    accumulation = _GroupView(AccumulationConfig)
    data = _GroupView(DataConfig)
    evaluation = _GroupView(EvaluationConfig)
    checkpointing = _GroupView(CheckpointingConfig)
    output = _GroupView(OutputConfig)

    @property
    def run_dir(self) -> str:
        """base_output_directory/run_name: metrics, traces, checkpoints and HLO go here.

        Defaults: base_output_directory "outputs", run_name the model_name (the
        same on every process of a multi-host run, and again on a restart).
        """
        return os.path.join(
            self.base_output_directory or "outputs", self.run_name or self.model_name
        )


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
