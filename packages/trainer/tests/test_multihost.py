"""2 processes x 4 CPU devices (gloo, 127.0.0.1) give the losses of 1 process x 8."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
TRAIN = Path(sys.executable).parent / "train"
STEP = re.compile(r"^step\s+(\d+)\s+loss ([\d.]+)\s+grad_norm ([\d.]+)", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(runner, tmp_path):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [
        "model_name=tagtrain-tiny",
        "dtype=float32",
        "per_device_batch_size=4",
        "steps=3",
        f"base_output_directory={tmp_path}",
        "--num_cpu_devices=4",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    procs = [
        subprocess.Popen(
            [str(TRAIN), *args, f"--process_id={i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert "processes: 2 (this is 0), 8 devices, 4 local" in outputs[0]
    assert "processes: 2 (this is 1), 8 devices, 4 local" in outputs[1]
    # Process 0's metrics file holds full-precision values; process 1 prints the same.
    lines = (tmp_path / "tagtrain-tiny" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert STEP.findall(outputs[1]) == STEP.findall(outputs[0])
    # The same conftest defaults (tiny, f32, per-device batch 4) on 8 devices here.
    reference, _ = runner(3)
    for key, name in (("learning/loss", "loss"), ("learning/grad_norm", "grad_norm")):
        np.testing.assert_allclose(
            [r[key] for r in records], [m[name] for m in reference], rtol=1e-5
        )
