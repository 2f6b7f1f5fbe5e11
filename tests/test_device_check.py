"""benchmarks/device_check.sh keeps working on CPU: one row per path on the page it writes."""

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _device_check():
    sys.path.insert(0, str(BENCHMARKS))  # device_check imports benchlib from there
    spec = importlib.util.spec_from_file_location("device_check", BENCHMARKS / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_gpu_estimate():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(
        "bench_gpu_estimate", BENCHMARKS / "bench_gpu_estimate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_estimate_reads_the_reference_time_off_the_device_page(tmp_path):
    # Before a device run writes device_check_profile.json, the held-out row's measured
    # time is the committed page's dense-reference line (not another "ms per step").
    estimate = _bench_gpu_estimate()
    estimate.PROFILE_JSON = str(tmp_path / "absent.json")
    ms = estimate.measured()["reference_ms"]
    page = (ROOT / "benchmarks" / "results" / "device_check.md").read_text()
    section = page.split("Plain-JAX dense reference", 1)[1].splitlines()
    line = next(ln for ln in section if ln.startswith("- "))
    assert ms is not None and f": {ms:.1f} ms per step" in line


def _rows(page: str) -> list[list[str]]:
    table = [ln for ln in page.splitlines() if ln.startswith("|")][2:]
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in table]


def test_variant_parsing_and_the_page_without_running_anything():
    dc = _device_check()
    assert dc.variant("fused:fused_accumulation=true,accum_dtype=bfloat16") == (
        "fused",
        {"fused_accumulation": "true", "accum_dtype": "bfloat16"},
    )
    with pytest.raises(SystemExit, match="expected NAME:key=value"):
        dc.variant("fused:fused_accumulation")
    args = dc.parse_args(["--cpu", "--variant", "fused:fused_accumulation=true"])
    rows = [
        {"path": "deferred", "overrides": "", "status": "ok", "step_ms": 12.5, "devices": 8},
        {"path": "fused", "overrides": "fused_accumulation=true", "status": "OOM"},
    ]
    page = "\n".join(dc.page(args, dc.SHAPES["cpu"], rows, ["a note"]))
    assert "--cpu --variant fused:fused_accumulation=true" in page
    cells = _rows(page)
    assert [(r[0], r[2], r[-1]) for r in cells] == [
        ("deferred", "12.5", "ok"),
        ("fused", "-", "OOM"),
    ]


@pytest.mark.slow
def test_cpu_run_writes_one_row_per_path(tmp_path):
    # Minutes on the 2-core machine under load (two tagtrain-tiny compiles); no timing asserted.
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    # A results folder that does not exist yet is made (a lent TPU's run once wrote
    # nothing: its --out was missing when the profile was saved, after every path ran).
    tmp_path = tmp_path / "new" / "results"
    args = ["--cpu", "--steps", "2", "--out", str(tmp_path), "--variant", "bogus:no_such_key=1"]
    proc = subprocess.run(
        ["bash", str(BENCHMARKS / "device_check.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (tmp_path / "device_check.md").read_text()
    assert page in proc.stdout  # the page is printed too
    rows = {r[0]: r for r in _rows(page)}
    assert list(rows) == ["deferred", "fused", "per_microbatch", "scanned", "bogus"]
    assert {rows[p][-1] for p in ("deferred", "fused", "per_microbatch", "scanned")} == {"ok"}
    # A key the trainer lacks is an error row, not a failed check.
    assert rows["bogus"][-1] == "error: unknown config key 'no_such_key'"
    with open(tmp_path / "device_check.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["path"] for r in table] == ["deferred", "fused", "per_microbatch", "scanned", "bogus"]
    deferred, fused, per_microbatch, scanned = table[0], table[1], table[2], table[3]
    # Deferred reduces after the loop only; per microbatch in it; same first loss.
    assert float(deferred["reduce_mib_in_loop"]) == 0 < float(per_microbatch["reduce_mib_in_loop"])
    assert float(deferred["tokens_per_s"]) > 0
    assert float(deferred["loss"]) == pytest.approx(float(per_microbatch["loss"]), rel=1e-4)
    assert float(fused["loss"]) == pytest.approx(float(deferred["loss"]), rel=1e-5)
    assert float(fused["reduce_mib_in_loop"]) == 0
    # scan_layers=true is how a CPU runs auto anyway: the same program's numbers.
    assert float(scanned["loss"]) == pytest.approx(float(deferred["loss"]), rel=1e-6)


def test_profile_json_for_the_refit(tmp_path):
    # What bench_gpu_estimate.py --refit reads: the profiled path's whole keys.
    dc = _device_check()
    args = dc.parse_args(["--out", str(tmp_path)])
    profile = {"kernels_per_step": 100.0, "ms_per_step_by_category": {"matmul": 2.5}, "top": []}
    rows = [
        {"path": "deferred", "status": "ok", "step_ms": 3.0, "device": "X", "profile": profile},
        {"path": "fused", "status": "ok", "step_ms": 4.0, "profile": None},
    ]
    shape = {**dc.SHAPES["accelerator"], "gradient_accumulation_steps": "4"}
    reference = {"status": "ok", "step_ms": 1.5, "losses": [2.0], "shape": {"d": 8}}
    dc.write_profile(args, shape, dc.PATHS, rows, {"reference": reference})
    with open(tmp_path / "device_check_profile.json") as f:
        data = json.load(f)
    assert data["overrides"] == {**shape, **dc.PATHS["deferred"]}
    assert (data["path"], data["step_ms"], data["device"]) == ("deferred", 3.0, "X")
    assert data["ms_per_step_by_category"] == {"matmul": 2.5}
    # The dense reference's time: the estimate page's held-out row is checked against it.
    assert data["reference"] == {"status": "ok", "step_ms": 1.5}
    estimate = _bench_gpu_estimate()
    estimate.PROFILE_JSON = str(tmp_path / "device_check_profile.json")
    assert estimate.measured()["reference_ms"] == 1.5
    dc.write_profile(args, shape, dc.PATHS, rows[1:], {})  # no profile: nothing written over it
    with open(tmp_path / "device_check_profile.json") as f:
        assert json.load(f)["path"] == "deferred"


def test_only_a_gpu_path_is_profiled():
    # The profile is a GPU trace's kernels by category, what --refit fits the GPU
    # calibration to; a TPU run once wrote an empty one (0 kernels) as if from a GPU.
    dc = _device_check()
    spec = {"steps": 1, "profile": True, "overrides": {**dc.SHAPES["cpu"], "steps": "1"}}
    row = dc.train_path(spec)
    assert row["status"] == "ok", row
    assert row["profile"] is None
