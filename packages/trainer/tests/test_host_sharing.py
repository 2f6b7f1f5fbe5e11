"""Commands that share a host (issue 56): export-hf starts no JAX backend at all, a CPU
run and a GPU compile never load libtpu (so never take its lockfile), the CUDA plugin's
no-driver lines are left out where no driver is, and a user's XLA_FLAGS dump directory
is honoured by a GPU compile.

The JAX platform checks run in a fresh process (this one started its CPU backend long
ago) with JAX_PLATFORMS unset, as a user's shell has it."""

import os
import subprocess
import sys

import pytest

from trainer import _host
from trainer.config import make_config
from trainer.run import gpu_topology
from trainer.run import run as run_lib

NO_DRIVER_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    f"I0000 00:00:1.2 17 cudart_stub.cc:31] {_host.NO_DRIVER}\n",
]
# After the command, in its process: the platforms JAX started or tried (a failed try
# is recorded too), whether libtpu is loaded and any open file of its lockfile
# (libtpu takes /tmp/libtpu_lockfile when it starts; a process without libtpu
# cannot hold it), and the command's exit code.
PROBE = """
import os
from jax._src import xla_bridge
maps = open("/proc/self/maps").read()
fds = [os.path.join("/proc/self/fd", f) for f in os.listdir("/proc/self/fd")]
lockfiles = [f for f in fds if os.path.exists(f) and "libtpu" in os.readlink(f)]
tried = sorted(set(xla_bridge._backends) | set(xla_bridge._backend_errors))
print("probe:", tried, "libtpu" in maps, lockfiles, code)
"""
EXPORT_PROBE = (
    """
import sys
from trainer.io import export_hf
code = export_hf.main(sys.argv[1:])
"""
    + PROBE
)
# The `train` console script's own entry (trainer._scripts), then the probe.
TRAIN_PROBE = (
    """
import sys
from trainer import _scripts
sys.argv = ["train", *sys.argv[1:]]
code = 0
try:
    _scripts.train()
except SystemExit as exit:
    code = exit.code
"""
    + PROBE
)


def _user_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tagtrain-tiny run's checkpoint of step 1 (nothing compiled)."""
    out = tmp_path_factory.mktemp("host")
    config = make_config({"async_checkpointing": "false", "base_output_directory": str(out)})
    run = run_lib.setup(config)
    run.checkpoints.save(1, run.state)
    run.checkpoints.wait()
    return run.config.run_dir


def test_export_hf_starts_no_backend(run_dir, tmp_path):
    """The checkpoint is read from its files on the host (io/checkpoint_host.py): JAX
    starts no platform at all, not even the CPU (orbax's restore would)."""
    args = [f"run_dir={run_dir}", f"output={tmp_path / 'out'}"]
    done = subprocess.run(
        [sys.executable, "-c", EXPORT_PROBE, *args],
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "probe: [] False [] 0" in done.stdout, done.stdout + done.stderr[-3000:]
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.aot  # libtpu installed (the tpu extra): what a CPU run must not load
def test_cpu_run_never_loads_libtpu(tmp_path):
    """JAX_PLATFORMS=cpu: a training run starts the CPU platform only, so a TPU run or
    compile beside it finds libtpu's lockfile free."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            TRAIN_PROBE,
            "steps=1",
            "enable_checkpointing=false",
            f"base_output_directory={tmp_path}",
            "run_name=r",
        ],
        # Unoptimised CPU kernels (as the cpu tier compiles): what is checked is which
        # platforms start, decided before XLA compiles anything.
        env=_user_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "probe: ['cpu'] False [] 0" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_no_driver_lines_are_left_out_and_every_other_line_kept():
    other = ["E0000 something else went wrong\n", "WARNING: All log messages ... \n"]
    assert _host._kept([*NO_DRIVER_LINES, other[0], *NO_DRIVER_LINES, other[1]]) == other


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("", None),
        ("--xla_gpu_enable_latency_hiding_scheduler=true", None),
        ("--xla_dump_to=/tmp/a --xla_dump_hlo_as_text", "/tmp/a"),
        ("--xla_dump_to=/tmp/a --xla_dump_to=/tmp/b", "/tmp/b"),
        ("--xla_dump_to=-", None),
    ],
)
def test_user_dump_dir_reads_xla_flags(monkeypatch, flags, expected):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert gpu_topology.user_dump_dir() == expected


@pytest.mark.aot
def test_cuda_plugin_no_driver_lines_are_quiet():
    pytest.importorskip(gpu_topology.PLUGIN, reason="needs the gpu extra: uv run --extra gpu")
    start = "import jax; jax.config.update('jax_platforms', 'cpu'); jax.devices()"
    plain = subprocess.run(
        [sys.executable, "-c", start], env=_user_env(), capture_output=True, text=True
    )
    if _host.NO_DRIVER not in plain.stderr:
        pytest.skip("this host has a CUDA driver: the plugin finds it and says nothing")
    quiet = subprocess.run(
        [sys.executable, "-c", f"from trainer import _host; _host.quiet_jax_import(); {start}"],
        env=_user_env(),
        capture_output=True,
        text=True,
    )
    assert quiet.returncode == 0, quiet.stderr
    assert _host.NO_DRIVER not in quiet.stderr and "absl::InitializeLog" not in quiet.stderr


@pytest.mark.aot
def test_gpu_compile_reads_and_keeps_the_users_dump(tmp_path):
    """A GPU compile (JAX_PLATFORMS unset, as a user's shell has it) keeps the user's
    dump directory and never loads libtpu (its lockfile stays free for a TPU run)."""
    pytest.importorskip(gpu_topology.PLUGIN, reason="needs the gpu extra: uv run --extra gpu")
    dump = tmp_path / "dump"
    args = ["model_name=tagtrain-test", "compile_topology=h100-1"]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            TRAIN_PROBE,
            *args,
            f"base_output_directory={tmp_path}",
            "run_name=r",
        ],
        env=_user_env(XLA_FLAGS=f"--xla_dump_to={dump}"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "probe: ['cpu'] False [] 0" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert "kernels launched per step" in done.stdout
    thunks = (tmp_path / "r" / "aot_h100-1.thunks.txt").read_text()
    # the kept thunk sequence is the step's, read from the user's dump, which stays
    assert thunks in {p.read_text() for p in dump.glob("*.thunk_sequence.txt")}
