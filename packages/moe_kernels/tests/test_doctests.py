"""The docstring examples of moe_kernels' routing entry points (MoEConfig, route,
update_routing_bias) run on tiny arrays: the examples cannot drift from the code."""

import pytest

import moe_kernels
from moe_kernels import config, routing

MODULES = (config, routing)
ENTRY_POINTS = ("MoEConfig", "route", "update_routing_bias")


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module, api_docs):
    api_docs.run_examples(module)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_has_an_example(name):
    assert ">>>" in getattr(moe_kernels, name).__doc__
