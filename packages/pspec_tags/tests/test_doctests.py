"""Every public function's docstring example runs (on the 8 virtual CPU devices the
root conftest sets up), and README.md's function list is `pspec_tags.__all__`: the
examples and the list cannot drift from the code."""

import doctest
import pathlib
import re

import pytest

import pspec_tags
from pspec_tags import carry, guards, logical, ops, specs, values

MODULES = (carry, guards, logical, ops, specs, values)
README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no docstring example"
    assert result.failed == 0


def test_every_public_function_has_an_example():
    missing = [
        name
        for name in pspec_tags.__all__
        if callable(getattr(pspec_tags, name))
        and not isinstance(getattr(pspec_tags, name), type)
        and ">>>" not in (getattr(pspec_tags, name).__doc__ or "")
    ]
    assert not missing


def test_readme_function_list_is_all():
    text = README.read_text()
    start = text.index("All functions and names (`__all__`):")
    paragraph = text[start : text.index("\n\n", start)]
    listed = re.findall(r"`([A-Za-z_]+)`", paragraph.split(":", 1)[1])
    assert sorted(listed) == sorted(pspec_tags.__all__)
    assert len(listed) == len(set(listed))
