"""One data-source shape (issue 56): every format is one module with the same three
names, chosen once, by (dataset_type, use_sft), in input_pipeline.FORMATS; training and
evaluation both open their sources through it. No model is built, nothing compiles."""

import types
import typing

import numpy as np
import pytest

from trainer.config import ConfigError, make_config, mesh_shape
from trainer.config.run_keys import DataConfig
from trainer.data import eval_data, input_pipeline


def test_every_dataset_type_has_one_format_module_with_the_same_interface():
    dataset_types = typing.get_args(typing.get_type_hints(DataConfig)["dataset_type"])
    assert {t for t, sft in input_pipeline.FORMATS if not sft} == set(dataset_types)
    for choice, module in input_pipeline.FORMATS.items():
        assert isinstance(module.READS, tuple), choice
        assert callable(module.train_source) and callable(module.eval_source), choice


class _Rows:
    """A constant source: every row of every batch is `value`."""

    def __init__(self, value, global_batch, num_batches):
        self.value, self.global_batch, self.num_batches = value, global_batch, num_batches

    def rows(self, step, start, stop):
        return {"inputs": np.full((stop - start, 4), self.value, np.int32)}

    def describe(self):
        return f"fake {self.value}"


def test_a_new_format_is_one_module_and_one_row(monkeypatch):
    """A format added to the table alone serves training and the eval set: nothing else
    branches on dataset_type."""
    fake = types.SimpleNamespace(
        READS=("dataset_path",),
        train_source=lambda config, batch: _Rows(1, batch, None),
        eval_source=lambda config, batch: _Rows(2, batch, 3),
    )
    monkeypatch.setitem(input_pipeline.FORMATS, ("text", False), fake)
    config = make_config({"dataset_type": "text", "dataset_path": "x", "eval_interval": "2"})
    source = input_pipeline.make_source(config, 8)
    assert source.describe() == "fake 1" and source.rows(0, 0, 8)["inputs"].shape == (8, 4)
    eval_set = eval_data.make_eval_set(config, 8, mesh_shape(config, 8))
    assert (eval_set.steps, eval_set.batch_size, eval_set.note) == (3, 8, "fake 2")
    # the format's READS decide which keys are refused: tokenizer_path is not read here
    with pytest.raises(ConfigError, match=r"^tokenizer_path='t' is set but dataset_type=text; "):
        input_pipeline.make_source(
            make_config({"dataset_type": "text", "dataset_path": "x", "tokenizer_path": "t"}), 8
        )
