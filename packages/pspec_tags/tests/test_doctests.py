"""Every public function's docstring example runs (on the 8 virtual CPU devices the
root conftest sets up), and the package README's function list is `pspec_tags.__all__`: the
examples and the list cannot drift from the code."""

import pathlib

import pytest

import pspec_tags
from pspec_tags import carry, guards, logical, ops, specs, values

MODULES = (carry, guards, logical, ops, specs, values)
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module, api_docs):
    api_docs.run_examples(module)


def test_every_public_function_has_an_example(api_docs):
    assert not api_docs.functions_without_example(pspec_tags)


def test_readme_function_list_is_all(api_docs):
    api_docs.check_readme_lists_all(README, pspec_tags)
