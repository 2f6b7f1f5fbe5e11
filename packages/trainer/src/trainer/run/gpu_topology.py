"""Compile-only NVIDIA GPU topologies for `train compile_topology=h100-8` (aot.py).

jax's CUDA plugin can compile for GPUs it cannot see: with JAX_PLATFORMS=cpu,
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`
returns compile-only devices (platform "gpu") described by a
`stream_executor.GpuTargetConfigProto` text proto instead of a live device query.
We write that proto from the chips' datasheet figures (CHIPS), not from XLA's
spec files, so the figures stay ours and visible.

Needs the `gpu` extra (jax's CUDA 12 plugin and the ptxas wheel, pinned with
jax): `uv run --extra gpu train compile_topology=h100-8 ...`.

The compile also asks XLA for its dump (`xla_dump_to`), whose
`*.thunk_sequence.txt` lists the kernels the step launches, nested under its
while loops; `kernels_of_dump` weights them by trip count (hlo_tools.thunks). A
`--xla_dump_to` in XLA_FLAGS is honoured: the dump goes there and is read from there.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import shutil

import jax
from jax.experimental import topologies

import hlo_tools
from trainer.config import ConfigError
from trainer.run import report

GIB = 1024**3
PLUGIN = "jax_plugins.xla_cuda12"
EXTRA_HINT = "uv sync --extra gpu (or run it as: uv run --extra gpu train ...)"


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet figures of one GPU (SXM form factor), as the target config needs them."""

    description: str  # what a live device reports as device_kind
    hbm_gib: float
    memory_bandwidth: float  # bytes/s
    sm_count: int
    clock_ghz: float  # boost clock
    l2_bytes: int
    compute_capability: tuple[int, int]


# NVIDIA H100 / H200 datasheets (SXM): both Hopper GH100 with 132 SMs at up to
# 1.98 GHz and a 50 MB L2; they differ in memory (80 GB HBM3 at 3.35 TB/s, 141 GB
# HBM3e at 4.8 TB/s). Memory in GiB as the trainer's reports count it.
CHIPS = {
    "h100": Chip("NVIDIA H100 80GB HBM3", 80.0, 3.35e12, 132, 1.98, 50 * 1024**2, (9, 0)),
    "h200": Chip("NVIDIA H200", 141.0, 4.8e12, 132, 1.98, 50 * 1024**2, (9, 0)),
}
# Per-SM limits shared by every compute capability 9.0 part (CUDA programming
# guide, "Technical Specifications per Compute Capability").
_SM90 = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * 1024,
    "shared_memory_per_core": 228 * 1024,
    "shared_memory_per_block_optin": 227 * 1024,
    "threads_per_core_limit": 2048,
    "fpus_per_core": 128,  # FP32 cores per SM
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
}
# The cuDNN version XLA may assume when it plans fusions (no cuDNN is called in
# a compile-only run). No cub_version: with one, XLA:GPU lowers large sorts to
# CUB and asks the (absent) device for its properties (cudaErrorInvalidDevice).
_DNN_VERSION = (9, 8, 0)
GPUS_PER_HOST = (1, 2, 4, 8)


def target_config(chip: Chip) -> str:
    """The GpuTargetConfigProto text proto describing `chip`."""
    major, minor = chip.compute_capability
    info = dict(_SM90)
    info.update(
        core_count=chip.sm_count,
        memory_bandwidth=int(chip.memory_bandwidth),
        l2_cache_size=chip.l2_bytes,
        clock_rate_ghz=chip.clock_ghz,
        device_memory_size=int(chip.hbm_gib * GIB),
    )
    fields = " ".join(f"{k}: {v}" for k, v in info.items())
    dnn = " ".join(
        f"{k}: {v}" for k, v in zip(("major", "minor", "patch"), _DNN_VERSION, strict=True)
    )
    return (
        f"gpu_device_info {{ {fields} cuda_compute_capability {{ major: {major} "
        f'minor: {minor} }} }} platform_name: "CUDA" dnn_version_info {{ {dnn} }} '
        f'device_description_str: "{chip.description}"'
    )


# The share of a GPU's memory a JAX process's allocator takes by default (jax's GPU
# memory docs: XLA_PYTHON_CLIENT_MEM_FRACTION, 75% preallocated at start-up). A step
# compiled to fit the chip's HBM but not that share runs out of memory on the
# device unless the variable is raised.
ALLOCATOR_FRACTION = 0.75
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def allocator_line(total_bytes: int, hbm_gib: float) -> str | None:
    """The AOT report's hint when a GPU step fits the chip's HBM but not the share
    JAX's allocator takes by default: the XLA_PYTHON_CLIENT_MEM_FRACTION that holds
    it (2% headroom, at most 0.99). None when the default share holds it or the
    chip cannot."""
    hbm = hbm_gib * GIB
    if total_bytes <= ALLOCATOR_FRACTION * hbm or total_bytes > hbm:
        return None
    needed = min(0.99, math.ceil(total_bytes / hbm * 100 + 2) / 100)
    return (
        f"  on the device: JAX's allocator takes {ALLOCATOR_FRACTION:g} of HBM "
        f"({ALLOCATOR_FRACTION * hbm_gib:.2f} GiB) by default; run with "
        f"{ALLOCATOR_ENV}={needed:.2f}"
    )


def require_plugin() -> None:
    """ConfigError (one line, how to get it) when jax's CUDA plugin is not installed."""
    try:
        found = importlib.util.find_spec(PLUGIN) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        found = False
    if not found:
        raise ConfigError(
            f"compiling for a GPU topology needs jax's CUDA plugin ({PLUGIN}): {EXTRA_HINT}"
        )


def devices(chip_name: str, gpus_per_host: int, hosts: int) -> list:
    """Compile-only GPU devices: `hosts` hosts of `gpus_per_host` GPUs, host by host
    (ids are host-major, so each host is one block of the mesh's outer dcn_ axes)."""
    require_plugin()
    # The plugin would otherwise look for a driver (cuInit) and fail on a CPU host.
    jax.config.update("jax_platforms", "cpu")
    topology = topologies.get_topology_desc(
        platform="cuda",
        target_config=target_config(CHIPS[chip_name]),
        topology=f"{hosts}x1x{gpus_per_host}",
    )
    return sorted(topology.devices, key=lambda d: d.id)


def user_dump_dir() -> str | None:
    """The directory XLA_FLAGS' `--xla_dump_to=DIR` names (the last one given), or
    None: XLA dumps every compile there, so the GPU compile reads its thunk sequence
    from it instead of from a scratch directory of its own (and deletes nothing)."""
    given = [
        flag.split("=", 1)[1]
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if flag.startswith("--xla_dump_to=")
    ]
    # "-" (stdout) and "sponge" are XLA's names for no directory: a scratch one is used
    return given[-1] if given and given[-1] not in ("-", "sponge") else None


def thunk_sequences(dump_dir: str) -> set[str]:
    """The *.thunk_sequence.txt files in `dump_dir` now (before a compile adds its own)."""
    return set(glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")))


def thunk_files(dump_dir: str, earlier: set[str] = frozenset()) -> tuple[str, str]:
    """The train step's thunk sequence and thunk metadata files in an XLA dump.

    The dump holds every module compiled while it was set; the step is the one
    with the largest thunk sequence, of those not in `earlier` (a user's dump
    directory holds the earlier compiles too)."""
    sequences = thunk_sequences(dump_dir) - set(earlier)
    if not sequences:
        raise RuntimeError(f"XLA wrote no *.thunk_sequence.txt under {dump_dir}")
    sequence = max(sequences, key=os.path.getsize)
    metadata = sequence.removesuffix(".thunk_sequence.txt") + ".thunk_metadata.txt"
    return sequence, metadata


def metadata_path(thunks_path: str) -> str:
    """Where the thunk metadata is kept beside a kept thunk sequence (x.thunks.txt ->
    x.thunk_metadata.txt)."""
    return thunks_path.removesuffix(".thunks.txt") + ".thunk_metadata.txt"


def kernels_of_dump(
    dump_dir: str, hlo_text: str, keep_as: str | None = None, earlier: set[str] = frozenset()
):
    """hlo_tools.KernelCount of the step in `dump_dir` (its files not in `earlier`);
    its thunk sequence is copied to `keep_as` (for a reader) when given, its thunk
    metadata (which HLO instruction each thunk runs, what the GPU estimate reads)
    beside it as `metadata_path(keep_as)`."""
    sequence, metadata = thunk_files(dump_dir, earlier)
    if keep_as:
        shutil.copyfile(sequence, keep_as)
        shutil.copyfile(metadata, metadata_path(keep_as))
    with open(sequence) as f, open(metadata) as g:
        return hlo_tools.kernels_per_step(f.read(), g.read(), hlo_tools.parse(hlo_text))


def report_lines(kernels, run, hlo_path: str) -> list[str]:
    """The GPU part of the AOT report: the grouped matmul and GEMMs compiled, and the kernels
    per step (hlo_tools.format_kernels) with where the thunk sequence went."""
    thunks = hlo_path.removesuffix(".hlo") + ".thunks.txt"
    return [
        *report.grouped_matmul_lines(run.config, run.ctx),
        *report.gemm_lines(run.config, run.ctx),
        *hlo_tools.format_kernels(kernels),
        f"wrote the thunk sequence to {thunks}",
    ]
