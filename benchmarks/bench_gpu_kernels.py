"""Kernels a GPU step launches, deviceless: deepseek3-small compiled for H100s on this host.

deepseek3-small at per_device_batch_size=2, GA=4 (issue #43's deviceless shape),
compiled by jax's CUDA plugin for compile-only H100 topologies (`train
compile_topology=h100-N`, trainer/run/gpu_topology.py), never run. Each row flips
one key against the defaults and records what the compile shows: kernels launched
per step (XLA's thunk sequence weighted by loop trip counts, hlo_tools.kernels_per_step)
and their mix, the kernels of one microbatch-loop trip and of one layer-loop trip,
XLA's peak live memory per device, and the compile time on this host.

What it is for: on a GPU every kernel is a launch, and a step made of many small
kernels is bound by launching them (the 2-step profile of issue #43:
../docs/performance.md, "On a GPU"). The rows show which layout decisions change the
count: the layer loop scanned or unrolled (scan_layers; auto unrolls on GPUs,
config/layer_loop.py), the routed experts' grouped matmul (grouped_matmul; auto is
the Mosaic-GPU grouped GEMM on these Hopper targets, padded_blocks the fallback),
what the backward recomputes (remat_policy), f32 or bf16 parameters (weight_dtype),
and 8 GPUs with ZeRO-1.

    JAX_PLATFORMS=cpu uv run --extra gpu python benchmarks/bench_gpu_kernels.py [--first N]

Writes benchmarks/results/gpu_kernels.md and .csv (after every compile: a run cut
short keeps its rows). `--first N` compiles only the first N rows.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import benchlib as bl  # noqa: E402

from hlo_tools.thunks import OUTSIDE  # noqa: E402
from trainer.config import make_config  # noqa: E402
from trainer.run import aot  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra gpu python benchmarks/bench_gpu_kernels.py"
SHAPE = {
    "model_name": "deepseek3-small",
    "per_device_batch_size": "2",
    "gradient_accumulation_steps": "4",
}
H100_1 = {"compile_topology": "h100-1"}
H100_8_ZERO1 = {"compile_topology": "h100-8", "shard_optimizer_over_data": "true"}
# (label, overrides on SHAPE), in priority order (--first N).
ROWS = [
    ("h100-1, defaults", H100_1),
    ("h100-1, grouped_matmul=padded_blocks", {**H100_1, "grouped_matmul": "padded_blocks"}),
    ("h100-1, scan_layers=true", {**H100_1, "scan_layers": "true"}),
    ("h100-8 ZeRO-1, defaults", H100_8_ZERO1),
    ("h100-8 ZeRO-1, scan_layers=true", {**H100_8_ZERO1, "scan_layers": "true"}),
    ("h100-1, remat_policy=full", {**H100_1, "remat_policy": "full"}),
    (
        "h100-1, scan_layers=true, remat_policy=minimal",
        {**H100_1, "scan_layers": "true", "remat_policy": "minimal"},
    ),
    (
        "h100-1, scan_layers=true, remat_policy=full",
        {**H100_1, "scan_layers": "true", "remat_policy": "full"},
    ),
    ("h100-1, weight_dtype=bfloat16", {**H100_1, "weight_dtype": "bfloat16"}),
]
CATEGORIES = ("matmul", "copy/transpose", "elementwise/fusion", "collective")


def _loop_trips(kernels) -> tuple[str, str]:
    """(kernels of one microbatch-loop trip, of one trip of each layer loop nested in
    it, summed), "-" where absent: from hlo_tools' per-trip counts, whose keys are
    loop paths nested with " > " (KernelCount)."""
    trips = kernels.per_trip
    microbatch = sum(n for loop, n in trips.items() if loop != OUTSIDE and " > " not in loop)
    layer = sum(n for loop, n in trips.items() if loop.count(" > ") == 1)
    return (f"{microbatch:,}" if microbatch else "-", f"{layer:,}" if layer else "-")


def measure(label: str, overrides: dict) -> dict:
    """One compile: its kernel counts, peak memory and compile time."""
    out = tempfile.mkdtemp(prefix="bench_gpu_kernels_")
    config = make_config({"base_output_directory": out, **SHAPE, **overrides})
    start = time.perf_counter()
    result = aot.compile_for_topology(config)
    seconds = time.perf_counter() - start
    kernels = result.kernels
    microbatch, layer = _loop_trips(kernels)
    row = {
        "row": label,
        "scan_layers": result.run.config.scan_layers,
        "kernels_per_step": kernels.total,
        **{category: kernels.by_category.get(category, 0) for category in CATEGORIES},
        "microbatch_trip": microbatch,
        "layer_trips_fwd_plus_bwd": layer,
        "peak_gib": result.memory.get("peak", result.memory["total"]) / bl.GIB,
        "compile_s": seconds,
        "tree": bl.revision(),
    }
    print(f"{label}: {kernels.total:,} kernels per step, {seconds:.0f} s", flush=True)
    return row


def page(rows: list[dict], wall: float) -> list[str]:
    notes = [
        "shape: deepseek3-small, per_device_batch_size=2, gradient_accumulation_steps=4, "
        "seq 1024, the trainer's defaults otherwise (attention: dot_product, since a "
        "compile-only GPU has no cuDNN)",
        bl.compiles_note(rows, wall, reuse=False),
        "kernels per step: XLA's thunk sequence, each launching thunk counted once per "
        "execution (the product of the trip counts of the loops around it); the device "
        "profile of issue #43 counted within a percent of it",
        "microbatch trip / layer trips: the kernels of one trip of the microbatch loop, "
        "and the sum over the layer loops nested in it (forward and backward) of one trip "
        "each; '-': no such loop (layers unrolled)",
    ]
    missing = [label for label, _ in ROWS if label not in {r["row"] for r in rows}]
    if missing:
        notes.append("not compiled in this run: " + "; ".join(missing))
    columns = ["row", "scan_layers", "kernels/step", *CATEGORIES]
    columns += ["microbatch trip", "layer trips", "peak GiB", "compile s"]
    body = [
        [
            r["row"],
            str(r["scan_layers"]).lower(),
            f"{r['kernels_per_step']:,}",
            *(f"{r[c]:,}" for c in CATEGORIES),
            r["microbatch_trip"],
            r["layer_trips_fwd_plus_bwd"],
            f"{r['peak_gib']:.2f}",
            f"{r['compile_s']:.0f}",
        ]
        for r in rows
    ]
    title = "Kernels per step on H100s, compiled on a CPU host (deepseek3-small)"
    return bl.header(title, COMMAND, notes) + bl.table(columns, body, "llrrrrrrrrr")


def main(argv: list[str]) -> None:
    first = int(argv[argv.index("--first") + 1]) if "--first" in argv else len(ROWS)
    rows, start = [], time.perf_counter()
    for label, overrides in ROWS[:first]:
        rows.append(measure(label, overrides))
        bl.write("gpu_kernels", page(rows, time.perf_counter() - start), rows)


if __name__ == "__main__":
    main(sys.argv[1:])
