"""The config's groups and docs/config.md: every key in one group with a meaning, the
group views, the reader scan, and the page regenerated in memory against the file."""

import ast
import dataclasses

import pytest

from trainer.config import FIELDS, GROUPS, Config, DataConfig, make_config
from trainer.config import reference as config_reference


def test_every_key_is_in_exactly_one_group_with_a_one_line_meaning():
    declared = [f.name for group in GROUPS.values() for f in dataclasses.fields(group)]
    assert sorted(declared) == sorted(FIELDS)
    assert len(declared) == len(set(declared))
    for field in dataclasses.fields(Config):
        meaning = field.metadata.get("meaning", "")
        assert meaning and "\n" not in meaning, field.name


def test_a_group_view_holds_that_groups_values():
    config = make_config({"model_name": "deepseek3-small", "dataset_path": "x", "steps": "7"})
    assert isinstance(config.data, DataConfig)
    assert config.data.dataset_path == "x"
    assert config.data.max_target_length == config.max_target_length == 1024
    assert config.training.steps == 7
    assert not hasattr(config.data, "steps")
    for name, group in GROUPS.items():
        view = getattr(config, name)
        assert type(view) is group
        for field in dataclasses.fields(group):
            assert getattr(view, field.name) == getattr(config, field.name)


SOURCE = '''
"""A docstring naming steps is no read."""
def f(config, run, data, metrics, overrides):
    a = config.vocab_size
    b = run.config.data.dataset_path
    c = getattr(config, "hf_train_files")
    d = data.dtype            # an array's dtype: dtype is no data-group key
    e = metrics["learning_rate"]
    g = {"learning_rate": a}
    h = config.run_dir
    for key in ("seed",):
        pass
    return overrides.get("hf_model_path"), f"ici_{e}_parallelism", f"{a}{b}"
'''


def test_the_scan_finds_reads_and_not_prose_or_records():
    keys = frozenset(FIELDS)
    derived = {"run_dir": {"base_output_directory", "run_name", "model_name"}}
    found = config_reference.keys_named(
        ast.parse(SOURCE), keys, derived, config_reference.CONFIG_NAMES
    )
    ici = {k for k in FIELDS if k.startswith("ici_")}
    expected = {"vocab_size", "dataset_path", "hf_train_files", "seed", "hf_model_path"}
    assert found == expected | derived["run_dir"] | ici


def test_every_key_has_a_reader():
    unread = [key for key, modules in config_reference.readers().items() if not modules]
    assert unread == [], f"keys no module reads (drop them or make them act): {unread}"


def test_docs_config_md_is_up_to_date():
    with open(config_reference.PAGE) as f:
        on_disk = f.read()
    if on_disk != config_reference.render():
        pytest.fail(f"docs/config.md is out of date: run `{config_reference.COMMAND}`")


GROUP_SOURCE = """
def f(model, data, parallelism):
    a = model.num_moe_layers          # ModelConfig's property: the two layer counts
    b = data.num_moe_layers           # no DataConfig property: no read
    c = parallelism.ici_parallelism() # ParallelismConfig's method: every ici_ key
    return open_column(data, "hf_eval_files")  # a key named beside a group view
"""


def test_the_scan_follows_a_groups_own_properties_and_arguments():
    keys = frozenset(FIELDS)
    derived = config_reference.derived_reads(keys)
    found = config_reference.keys_named(
        ast.parse(GROUP_SOURCE), keys, derived, config_reference.CONFIG_NAMES
    )
    ici = {k for k in FIELDS if k.startswith("ici_")}
    layers = {"base_num_decoder_layers", "first_num_dense_layers"}
    assert found == layers | ici | {"hf_eval_files"}
