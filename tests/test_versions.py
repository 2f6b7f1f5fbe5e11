"""The packages' declared dependencies are the ones they import, each with a tested floor.

The floors are what `nox -s wheels_minimum` pins (noxfile.declared_minimums) and what
docs/testing.md's "Tested versions" lists; these tests keep the three from drifting apart.
"""

import ast
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))

# Import name -> distribution name, for every third-party module the packages import.
DISTRIBUTION = {
    "absl": "absl-py",
    "accum": "accum",
    "etils": "etils",
    "flax": "flax",
    "grain": "grain",
    "jinja2": "jinja2",
    "hlo_tools": "hlo-tools",
    "jax": "jax",
    "matplotlib": "matplotlib",
    "ml_dtypes": "ml-dtypes",
    "moe_kernels": "moe-kernels",
    "numpy": "numpy",
    "optax": "optax",
    "orbax": "orbax-checkpoint",
    "pspec_tags": "pspec-tags",
    "pyarrow": "pyarrow",
    "tensorboardX": "tensorboardx",
    "tensorstore": "tensorstore",
    "tokenizers": "tokenizers",
}
WORKSPACE = {"accum", "hlo-tools", "moe-kernels", "pspec-tags", "tagtrain"}
# hlo_tools.jitted imports jax inside the functions that are handed a jitted JAX
# function, so hlo_tools itself stays standard-library only.
OPTIONAL = {"hlo_tools": {"jax"}}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project(package: Path) -> dict:
    return tomllib.loads((package / "pyproject.toml").read_text())["project"]


def _imports(package: Path) -> set[str]:
    """Top-level names of every absolute import under the package's src/."""
    names = set()
    for path in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def _noxfile():
    spec = importlib.util.spec_from_file_location("tagtrain_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_declared_dependencies_are_exactly_the_imported_ones(package):
    own = package.name
    imported = {
        m for m in _imports(package) - {own} if m not in sys.stdlib_module_names
    } - OPTIONAL.get(own, set())
    unknown = imported - DISTRIBUTION.keys()
    assert not unknown, f"{own} imports {sorted(unknown)}: add them to DISTRIBUTION"
    declared = {_normalize(Requirement(r).name) for r in _project(package)["dependencies"]}
    assert {DISTRIBUTION[m] for m in imported} == declared


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_third_party_dependency_has_a_floor(package):
    for line in _project(package)["dependencies"]:
        req = Requirement(line)
        if _normalize(req.name) not in WORKSPACE:
            assert any(s.operator == ">=" for s in req.specifier), f"{package.name}: {line}"


def test_the_minimum_session_pins_every_floor_and_the_docs_list_them():
    minimums = _noxfile().declared_minimums()
    third_party = {
        _normalize(Requirement(r).name) for p in PACKAGES for r in _project(p)["dependencies"]
    } - WORKSPACE
    assert set(minimums) == third_party
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split("## Tested versions", 1)[1].split("\n## ", 1)[0]
    for name, version in minimums.items():
        assert f"{name}=={version}" in section, (
            f"docs/testing.md's Tested versions lacks {name}=={version}"
        )
