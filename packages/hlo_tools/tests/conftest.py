"""Fixtures for hlo_tools tests: the example programs, compiled once per session."""

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).parent
DATA = HERE / "data"


def _load_programs():
    # Tests run with --import-mode=importlib, so sibling modules are loaded by path.
    spec = importlib.util.spec_from_file_location("hlo_tools_test_programs", HERE / "programs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def programs():
    """The programs module (sizes and builders)."""
    return _load_programs()


@pytest.fixture(scope="session")
def cpu_tagged(programs):
    """HLO text of the tagged program compiled for 8 CPU devices."""
    return programs.compile_cpu(tagged=True)


@pytest.fixture(scope="session")
def cpu_replicated(programs):
    """HLO text of the replicated-weights program compiled for 8 CPU devices."""
    return programs.compile_cpu(tagged=False)


@pytest.fixture(scope="session")
def data_dir():
    """tests/data, holding saved HLO dumps (see make_fixtures.py)."""
    return DATA
