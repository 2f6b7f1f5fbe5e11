"""Metrics JSONL, TensorBoard events, the xplane trace, plot-metrics, and the checks
on the profiler / topology / multi-host keys that run before anything compiles."""

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from trainer.config import ConfigError, make_config
from trainer.io import metrics, plots, profiling
from trainer.run import aot
from trainer.run.run import data_lines
from trainer.sharding import distributed

BIN = Path(sys.executable).parent
REQUIRED = (
    "step",
    "learning/loss",
    "learning/grad_norm",
    "learning/lr",
    "perf/tokens_per_s",
    "perf/step_time_s",
    "perf/mfu",
    "moe/tokens_per_expert",
    "moe/load_imbalance",
)


def _train(*args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [str(BIN / "train"), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


@pytest.fixture(scope="module")
def run_output(tmp_path_factory):
    """One 3-step tiny run with the profiler on step 2, evaluating 2 held-out synthetic
    batches after steps 2 and 3 (test_eval.py); (stdout, run directory)."""
    tmp = tmp_path_factory.mktemp("outputs")
    done = _train(
        "model_name=tagtrain-tiny",
        "steps=3",
        f"base_output_directory={tmp}",
        "run_name=tiny",
        "profiler=xplane",
        "profiler_start_step=2",
        "profiler_steps=1",
        "eval_interval=2",
        "eval_steps=2",
        cwd=tmp,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"metrics: {tmp / 'tiny' / 'metrics.jsonl'}" in done.stdout
    assert "profiler: xplane trace of steps 2-2" in done.stdout
    return done.stdout, tmp / "tiny"


@pytest.fixture(scope="module")
def run_dir(run_output):
    return run_output[1]


def test_metrics_jsonl_one_record_per_step_with_every_field(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "eval_loss" not in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    config = make_config({"model_name": "tagtrain-tiny"})
    for r in records:
        assert set(REQUIRED) <= set(r), set(REQUIRED) - set(r)
        assert r["perf/mfu"] is None  # no peak FLOP/s known for CPU devices
        loads = r["moe/tokens_per_expert"]
        assert [len(row) for row in loads] == [config.num_experts] * config.num_moe_layers
        # Every token picks num_experts_per_tok experts in every MoE layer.
        tokens = r["perf/tokens"]
        assert all(sum(row) == tokens * config.num_experts_per_tok for row in loads)
        mean = tokens * config.num_experts_per_tok / config.num_experts
        assert r["moe/load_imbalance"] == pytest.approx(max(max(row) for row in loads) / mean)
        assert r["learning/loss"] > 0 and r["perf/tokens_per_s"] > 0


def test_tensorboard_event_files_hold_the_scalars(run_dir, event_tags):
    files = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    tags = event_tags(files[0])
    for tag in ("learning/loss", "learning/lr", "perf/tokens_per_s", "moe/load_imbalance"):
        assert tags.get(tag) == [1, 2, 3], (tag, sorted(tags))
    assert "moe/load_imbalance/layer_1" in tags


def test_profiler_writes_an_xplane_trace_where_tensorboard_reads_it(run_dir):
    traces = list((run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_plot_metrics_draws_two_runs(run_dir, tmp_path):
    # A second run's records, written through the run's writer: what the plot reads
    # is the file, so six steps' figures stand in for a second compile and run.
    with metrics.MetricsWriter(str(tmp_path / "second"), tensorboard=False) as writer:
        for step in range(1, 7):
            writer.write(_fake(step))
    out = tmp_path / "plots"
    done = subprocess.run(
        [str(BIN / "plot-metrics"), str(run_dir), str(tmp_path / "second" / "metrics.jsonl")]
        + ["--output_dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for name in ("loss.png", "throughput.png", "load_balance.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    labels = [label for label, _ in plots.load_runs([str(run_dir), str(tmp_path / "second")])]
    assert labels == ["tiny", "second"]


def test_plot_metrics_rejects_an_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert plots.main([str(tmp_path / "metrics.jsonl"), "--output_dir", str(tmp_path)]) == 2


def _fake(step: int) -> dict:
    return {
        "step": step,
        "loss": 5.0 - step,
        "grad_norm": 1.0,
        "learning_rate": 1e-3,
        "tokens_per_s": 100.0,
        "step_time_s": 0.5,
        "tokens": 8.0,
        "tokens_per_expert": [[4, 4, 4, 4], [8, 4, 2, 2]],
    }


def test_record_names_and_load_imbalance():
    rec = metrics.record(_fake(1))
    assert rec["learning/loss"] == 4.0 and rec["learning/lr"] == 1e-3
    assert rec["moe/load_imbalance_per_layer"] == [1.0, 2.0]
    assert rec["moe/load_imbalance"] == 2.0
    assert rec["perf/mfu"] is None


def test_restart_keeps_earlier_steps_and_replaces_later_ones(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        for step in (1, 2, 3, 4):
            writer.write(_fake(step))
    # Resumed from a checkpoint at step 2: steps 3 and 4 are redone.
    with metrics.MetricsWriter(str(tmp_path), start_step=2, tensorboard=False) as writer:
        writer.write(_fake(3))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    # A fresh run (start 0) starts the file over; other processes write nothing.
    metrics.MetricsWriter(str(tmp_path), tensorboard=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    metrics.MetricsWriter(str(tmp_path / "p1"), process_index=1).write(_fake(1))
    assert not (tmp_path / "p1").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"profiler": "perfetto"}, "profiler='perfetto' is not one of"),
        ({"profiler": "xplane", "profiler_start_step": "0"}, "profiler_start_step=0 must be"),
        ({"profiler": "xplane", "profiler_steps": "0"}, "profiler_steps=0 must be"),
        ({"profiler": "xplane", "steps": "3", "profiler_start_step": "5"}, "after the last step"),
        ({"compile_topology": "v5e-9"}, "compile_topology='v5e-9' is not a known"),
        ({"compile_topology": "v5e-8", "compile_topology_num_slices": "0"}, "must be >= 1"),
        ({"compile_topolgy": "v5e-8"}, "did you mean 'compile_topology'"),
    ],
)
def test_bad_keys_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config = make_config(overrides)
        profiling.check(config.training, config.output)
        if config.compile_topology:
            aot.choose_topology(config.parallelism)


def test_topology_names_and_chip_counts():
    assert aot.TOPOLOGIES["v5e-8"].libtpu_name == "v5e:2x4"
    assert aot.TOPOLOGIES["v6e-4"].chips == 4
    # v5p counts TensorCores: v5p-128 is 64 chips.
    assert (aot.TOPOLOGIES["v5p-128"].libtpu_name, aot.TOPOLOGIES["v5p-128"].chips) == (
        "v5p:4x4x4",
        64,
    )


def test_unknown_topology_fails_before_compiling(tmp_path):
    done = _train("compile_topology=v5e-9", cwd=tmp_path)
    assert done.returncode == 2
    assert "compile_topology='v5e-9' is not a known TPU or GPU topology" in done.stderr
    assert "v5e-8" in done.stderr and "v5p-128" in done.stderr and "v6e-4" in done.stderr
    assert "h100-8" in done.stderr and "h200-1" in done.stderr
    assert "model:" not in done.stdout


def test_multi_process_flags_and_environment(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("MEGASCALE_NUM_SLICES", raising=False)
    assert not distributed.choose_launch().multi_process
    launch = distributed.choose_launch("127.0.0.1:1234", 2, 1)
    assert (launch.source, launch.num_processes, launch.process_id) == ("flags", 2, 1)
    with pytest.raises(ValueError, match="missing --process_id"):
        distributed.choose_launch("127.0.0.1:1234", 2, None)
    with pytest.raises(ValueError, match="--process_id=2 must be in"):
        distributed.choose_launch("127.0.0.1:1234", 2, 2)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:8476")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    launch = distributed.choose_launch()
    assert (launch.source, launch.coordinator_address, launch.num_processes) == (
        "environment",
        "10.0.0.1:8476",
        4,
    )


# Evaluation through the binary (test_eval.py has the rest).


def test_binary_prints_an_eval_line_after_each_eval_step(run_output):
    stdout, _ = run_output
    assert (
        "eval: every 2 steps and at the end, 2 batches of 8 sequences (<= 512 tokens) from "
        "synthetic, held-out stream 1 of seed 0"
    ) in stdout
    lines = [line for line in stdout.splitlines() if line.startswith(("step ", "eval "))]
    assert [line.split()[:3] for line in lines] == [
        ["step", "1", "loss"],
        ["step", "2", "loss"],
        ["eval", "step", "2"],
        ["step", "3", "loss"],
        ["eval", "step", "3"],
    ]
    fields = lines[2].split()
    assert fields[3] == "loss" and fields[5] == "perplexity" and fields[7] == "tokens"
    assert fields[8] == "512"  # 2 batches x 8 sequences x 32 tokens, no padding
    assert float(fields[6]) == pytest.approx(math.exp(float(fields[4])), rel=1e-3)


def test_binary_writes_eval_records_and_scalars_and_plots_them(run_output, event_tags, tmp_path):
    _, run_dir = run_output
    records = metrics.read(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 3]
    for r in records[1:]:
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
        assert r["eval_tokens"] == 512 and "learning/loss" in r  # merged with the step's
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    tags = event_tags(events)
    assert tags["eval_loss"] == [2, 3] and tags["eval_perplexity"] == [2, 3]
    assert plots.main([str(run_dir), "--output_dir", str(tmp_path)]) == 0
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


@pytest.mark.parametrize("saving", [True, False])
def test_startup_says_checkpoints_off_only_when_nothing_is_saved(saving):
    # Regression: "checkpoints: off" used to follow the checkpoint directory's own
    # line whenever the run did not start from load_parameters_path.
    checkpoints = types.SimpleNamespace(describe=lambda: "checkpoints: DIR (every 100 steps)")
    run = types.SimpleNamespace(
        config=make_config({}),
        source=None,
        evaluator=None,
        checkpoints=checkpoints if saving else None,
        restored_from=None,
        initialized_from="",
    )
    lines = data_lines(run)
    assert [line.startswith("checkpoints: off") for line in lines] == [not saving]
