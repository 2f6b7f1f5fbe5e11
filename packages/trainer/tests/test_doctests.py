"""The docstring examples of the trainer's configuration entry points
(parse_overrides, make_config, validate, moe_map.check) run: the examples cannot drift from the
code, and they show the one-line ConfigError a bad key or batch size gets."""

import pytest

from trainer.config import make, moe_map, validate

MODULES = (make, moe_map, validate)
ENTRY_POINTS = (make.make_config, validate.validate)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module, api_docs):
    api_docs.run_examples(module)


@pytest.mark.parametrize("function", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_entry_point_has_an_example(function):
    assert ">>>" in function.__doc__
