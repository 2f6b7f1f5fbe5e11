"""The `train` console script end to end, in a subprocess, output parsed."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = Path(sys.executable).parent / "train"
# MoE figures (imbalance, dropped, z) may sit between the loss and grad_norm.
STEP = re.compile(
    r"^step\s+(\d+)\s+loss ([\d.]+)(?:\s+(?!grad_norm)\S+ \S+)*"
    r"\s+grad_norm ([\d.]+)\s+lr ([\d.e+-]+)"
)


# Without libtpu (the cpu tier), the main run leaves JAX_PLATFORMS unset, as a user
# does: JAX then probes the accelerator backends, and the INFO lines it logs for the
# ones it does not find must not reach the terminal.
PROBES_BACKENDS = importlib.util.find_spec("libtpu") is None


def _train(*args, tmp_path, probe_backends=False):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if probe_backends:
        env.pop("JAX_PLATFORMS")
    return subprocess.run(
        [str(TRAIN), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    hlo = tmp / "step.hlo"
    metrics = tmp / "metrics.jsonl"
    done = _train(
        "model_name=tagtrain-tiny",
        "steps=3",
        "per_device_batch_size=1",
        # GA=4: at GA=2 auto ranks per_microbatch first (test_reduction_choice.py).
        "gradient_accumulation_steps=4",
        f"--dump_hlo={hlo}",
        f"--metrics_file={metrics}",
        tmp_path=tmp,
        probe_backends=PROBES_BACKENDS,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, hlo, metrics, done.stderr


def test_states_the_global_batch_in_maxtexts_meaning(output):
    # per_device_batch_size is per microbatch: 1 x 8 devices x GA 4 = 32 sequences.
    stdout = output[0]
    assert (
        "batch: 32 sequences x 32 tokens = 1,024 tokens per step "
        "(4 microbatches of 8; per_device_batch_size=1 per microbatch)"
    ) in stdout


def test_no_backend_probe_noise_on_the_terminal(output):
    stdout, stderr = output[0], output[3]
    assert "Unable to initialize backend" not in stderr + stdout
    assert stdout.splitlines()[0] == "model: tagtrain-tiny"


def test_zero_cpu_devices_is_a_one_line_flag_error(tmp_path):
    done = _train("steps=1", "--num_cpu_devices=0", tmp_path=tmp_path)
    assert done.returncode != 0
    assert "--num_cpu_devices=0" in done.stderr
    assert "Traceback" not in done.stderr and "mesh:" not in done.stdout


def test_prints_mesh_params_and_collective_verdict(output):
    stdout = output[0]
    assert "mesh: data=8 (explicit)" in stdout
    assert re.search(r"params: [\d.]+M total, [\d.]+M active per token", stdout)
    assert "gradient reduction: deferred to once per step over ('data',)" in stdout
    assert "OK: every gradient reduced once per step" in stdout
    # gradient_reduction_policy=auto (the default) says what it chose and assumed.
    assert (
        "gradient_reduction_policy=auto -> deferred (no hardware table entry for 'cpu': "
        "assumed v5e's figures" in stdout
    )


def test_one_line_per_step_with_finite_loss(output):
    stdout, _, metrics, _ = output
    steps = [STEP.match(line) for line in stdout.splitlines() if line.startswith("step ")]
    assert [int(m.group(1)) for m in steps] == [1, 2, 3]
    assert all(0 < float(m.group(2)) < 20 for m in steps)
    assert len(metrics.read_text().splitlines()) == 3


def test_dumped_hlo_reads_back_with_the_printed_hlo_report_command(output):
    stdout, hlo, _, _ = output
    command = re.search(r"inspect with: (hlo-report .*)\)$", stdout, re.MULTILINE).group(1)
    assert command == f"hlo-report {hlo} --mesh data=8 --over data"
    args = command.split()[1:]
    report = subprocess.run(
        [str(Path(sys.executable).parent / "hlo-report"), *args, "--check"],
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    assert (
        "all-reduce" in report.stdout and "OK: no reduction > 8 elements over data" in report.stdout
    )


def test_bad_override_fails_fast_naming_the_key(tmp_path):
    done = _train("steps=3", "gradient_accumulation_step=2", tmp_path=tmp_path)
    assert done.returncode == 2
    assert "unknown config key 'gradient_accumulation_step'" in done.stderr
    assert "did you mean 'gradient_accumulation_steps'" in done.stderr
    assert "mesh:" not in done.stdout  # rejected before building anything
