"""The docstring examples of hlo_tools' main entry points (parse, collectives,
traffic, in_loop_reductions, assert_reduced_once_per_step) run, from the HLO
snippet the package docstring sets up: the examples cannot drift from the code."""

import importlib

import pytest

import hlo_tools

# By module name: `hlo_tools.collectives` and `hlo_tools.traffic` are also functions.
MODULES = ("parser", "callgraph", "collectives", "traffic", "assertions", "dataflow")
ENTRY_POINTS = ("parse", "collectives", "traffic", "in_loop_reductions", "reaches_root")


def test_package_docstring_setup_parses(api_docs):
    assert hlo_tools.parse(api_docs.package_globs(hlo_tools)["HLO"]).entry_name == "main"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, api_docs):
    module = importlib.import_module(f"hlo_tools.{name}")
    api_docs.run_examples(module, extraglobs=api_docs.package_globs(hlo_tools))


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_has_an_example(name):
    assert ">>>" in getattr(hlo_tools, name).__doc__
