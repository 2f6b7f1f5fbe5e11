"""Each package builds as its own wheel; pspec_tags and hlo_tools install alone."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd=ROOT):
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def uv():
    path = shutil.which("uv")
    assert path, "uv must be on PATH (README: install uv first)"
    return path


@pytest.fixture(scope="module")
def wheels(uv, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    for package in ("pspec-tags", "hlo-tools", "accum", "moe-kernels", "tagtrain"):
        _run(uv, "build", "--package", package, "--wheel", "--out-dir", str(out))
    return out


def test_every_package_builds_its_own_wheel(wheels):
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert names == ["accum", "hlo_tools", "moe_kernels", "pspec_tags", "tagtrain"]


def test_pspec_tags_and_hlo_tools_install_alone(uv, wheels, tmp_path):
    venv = tmp_path / "venv"
    _run(uv, "venv", "--python", sys.executable, str(venv))
    python = venv / "bin" / "python"
    picked = [str(next(wheels.glob(f"{n}-*.whl"))) for n in ("pspec_tags", "hlo_tools")]
    _run(uv, "pip", "install", "--python", str(python), *picked)
    probe = (
        "import importlib.util, pspec_tags, hlo_tools;"
        "from jax.sharding import PartitionSpec as P;"
        "print(pspec_tags.with_reduced(P('x'), {'data'}));"
        "print(importlib.util.find_spec('accum'), importlib.util.find_spec('trainer'))"
    )
    out = _run(str(python), "-c", probe).stdout.split("\n")
    assert out[0] == "P('x', reduced={'data'})"
    assert out[1] == "None None"
