"""Every public function's docstring example runs (on the 8 virtual CPU devices the
root conftest sets up, from the setup in the package docstring), and the package
README's name list is `accum.__all__`: the examples and the list cannot drift from
the code."""

import importlib
import pathlib

import pytest

import accum

# The modules whose docstring examples run (accum.closure, accum.retype: internal
# modules with examples of their own).
NAMES = "accumulate closure dispatch gating guard microbatch plan retype schedule step tags zero1"
MODULES = tuple(importlib.import_module(f"accum.{name}") for name in NAMES.split())
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_package_docstring_setup_runs(api_docs):
    assert {"mesh", "w", "batch", "loss_fn", "SGD"} <= set(api_docs.package_globs(accum))


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module, api_docs):
    api_docs.run_examples(module, extraglobs=api_docs.package_globs(accum))


def test_every_public_function_has_an_example(api_docs):
    assert not api_docs.functions_without_example(accum)


def test_readme_name_list_is_all(api_docs):
    api_docs.check_readme_lists_all(README, accum)
