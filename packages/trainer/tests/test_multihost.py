"""2 processes x 4 CPU devices (gloo, 127.0.0.1) give the losses of 1 process x 8, and fall
back together from a damaged checkpoint shard."""

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
STEP = re.compile(
    r"^step\s+(\d+)\s+loss ([\d.]+)(?:\s+(?!grad_norm)\S+ \S+)*\s+grad_norm ([\d.]+)", re.M
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(tmp_path, *args):
    """Run the binary as processes 0 and 1 of a gloo group; their (stdout, stderr)."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    common = [
        *args,
        "--num_cpu_devices=4",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    procs = [
        subprocess.Popen(
            [str(TRAIN), *common, f"--process_id={i}"],
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
            outputs.append((out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


def test_two_processes_match_one(runner, tmp_path):
    args = [
        "model_name=tagtrain-tiny",
        "dtype=float32",
        "per_device_batch_size=4",
        "steps=3",
        f"base_output_directory={tmp_path}",
    ]
    outputs = [out for out, _ in _two_processes(tmp_path, *args)]
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


def test_a_damaged_shard_makes_both_processes_fall_back_to_the_same_step(tmp_path):
    """Process 1's array file of checkpoint 3 cut in half: both resume from step 2, and
    step 3 retrained gives the loss of the undamaged run bitwise. FSDP over both
    processes: each writes the shards it holds (under data parallelism process 0
    would hold replica 0 of every array and process 1 write none)."""
    args = [
        "model_name=tagtrain-tiny",
        "dtype=float32",
        "per_device_batch_size=4",
        "ici_data_parallelism=1",
        "ici_fsdp_parallelism=8",
        "steps=3",
        "checkpoint_period=1",
        f"base_output_directory={tmp_path}",
    ]
    _two_processes(tmp_path, *args)
    run_dir = tmp_path / "tagtrain-tiny"
    first = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = run_dir / "checkpoints"
    shard = max((ckpt / "3" / "state").glob("ocdbt.process_1/d/*"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    outputs = _two_processes(tmp_path, *args)
    for out, err in outputs:
        assert f"resumed from {ckpt / '2'} at step 2" in out
        warning = next(line for line in err.splitlines() if "is damaged" in line)
        assert warning.startswith("warning: checkpoint step 3 is damaged (state")
        assert f"moved to {ckpt / 'quarantine' / '3'}" in warning
    assert STEP.findall(outputs[1][0]) == STEP.findall(outputs[0][0])
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[2]["learning/loss"] == first[2]["learning/loss"]  # bitwise
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2", "3", "quarantine"]
