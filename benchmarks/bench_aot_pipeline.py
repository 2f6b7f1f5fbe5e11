"""DeepSeek-V3's pipeline layout compiled from this CPU host: 16 stages, experts, ZeRO-1.

Issue 57, item 5. deepseek3-671b (61 layers: 3 dense, 58 MoE over 16 stages, so
uneven: model/pipeline.py's slot layout) compiled for 2048 chips, as DeepSeek-V3 was
trained (16-way pipeline x 64-way expert x 2-way ZeRO-1 data parallelism):

- TPU v5p: 16 slices of v5p-256 (128 chips each), the stages across the slices
  (dcn_pipeline_parallelism=16), 64-way expert and 2-way data parallelism inside a
  slice, ZeRO-1 over data;
- H100: 256 hosts of 8 GPUs (h100-8 x 256), DeepSeek-V3's own layout: the stages
  across hosts (dcn_pipeline_parallelism=16), experts 64 ways over 8 hosts
  (dcn_expert_parallelism=8 x ici_expert_parallelism=8: one 'expert' mesh axis, its
  cross-host part major) and the batch 2 ways over the rest (dcn_data_parallelism=2),
  ZeRO-1 over it.

Both: bf16 weights (f32 optimizer state), capacity_factor 1.25, remat full, one
4096-token sequence per batch shard per microbatch, 32 microbatches (the bubble
15/47). Per device: compiled memory against HBM, collective bytes per step inside
the loops and outside them by kind (hlo_tools, trip-count weighted), the gradient
reductions inside loops (0: once per step, after the pipeline loop), compile time.

Writes benchmarks/results/aot_pipeline.md and .csv. Needs libtpu and the GPU plugin:

    JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu python benchmarks/bench_aot_pipeline.py

`--only NAME` compiles the rows whose label holds NAME; each row's figures are kept
under $TMPDIR/bench_aot_pipeline/, and the page shows every row kept there (each
stamped with the tree it was compiled at), so the rows can be compiled one at a time.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

# Another process (a test run) may hold libtpu; compile-only use can share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu python benchmarks/bench_aot_pipeline.py"
# DeepSeek-V3's model with the project's 671b layout choices (tests/layouts.py).
COMMON = {
    "model_name": "deepseek3-671b",
    "weight_dtype": "bfloat16",
    "capacity_factor": "1.25",
    "remat_policy": "full",
    "shard_optimizer_over_data": "true",
    "gradient_accumulation_steps": "32",
    # 2048 devices x 1/16 = 128 sequences per microbatch: one per batch shard.
    "per_device_batch_size": "0.0625",
}
V5P = {
    "compile_topology": "v5p-256",
    "compile_topology_num_slices": "16",
    "dcn_pipeline_parallelism": "16",
    "ici_expert_parallelism": "64",
    "ici_data_parallelism": "2",
}
ROWS = {
    "v5p-256 x 16 slices: 16 stages x 64 expert x 2 data": V5P,
    # The same layout with half the microbatches: what the pipeline's microbatches
    # cost in memory (test_pipeline_memory.py: an extra one costs its activations).
    "v5p, gradient_accumulation_steps=16": {
        **V5P,
        "gradient_accumulation_steps": "16",
    },
    "h100-8 x 256 hosts: 16 stages x 64 expert (8 hosts x 8) x 2 data": {
        "compile_topology": "h100-8",
        "compile_topology_num_slices": "256",
        "dcn_pipeline_parallelism": "16",
        "dcn_expert_parallelism": "8",
        "dcn_data_parallelism": "2",
        "ici_expert_parallelism": "8",
        "ici_data_parallelism": "1",
    },
}


CACHE = os.path.join(tempfile.gettempdir(), "bench_aot_pipeline")


def _cache_path(label: str) -> str:
    return os.path.join(CACHE, "".join(c if c.isalnum() else "_" for c in label) + ".json")


def compile_row(overrides: dict) -> dict:
    """One layout compiled: memory, collective bytes by kind and place, in-loop
    gradient reductions, the startup pipeline line, compile seconds."""
    import hlo_tools
    from trainer.config import make_config
    from trainer.run import aot
    from trainer.sharding import slices as slices_lib

    config = make_config({**overrides, "base_output_directory": tempfile.mkdtemp()})
    start = time.perf_counter()
    result = aot.compile_for_topology(config)
    seconds = time.perf_counter() - start
    text = result.compiled.as_text()
    module = hlo_tools.parse(text)
    traffic = hlo_tools.traffic(module)
    row = {
        "mesh": ", ".join(f"{a}={n}" for a, n in result.run.ctx.mesh.shape.items() if n > 1),
        "devices": module.num_devices,
        "memory_bytes": result.memory["total"],
        "hbm_bytes": result.hbm_bytes,
        "compile_s": seconds,
        "tree": bl.revision(),
        "pipeline": next(
            (line for line in aot.report_lines(result) if line.startswith("pipeline:")), ""
        ),
    }
    # By kind: a cross-slice hop of the TPU program is a megascale send ("one-to-one").
    row["kinds"] = {
        where: {kind: r["bytes_per_step"] for kind, r in traffic[where].items()}
        for where in ("in_loop", "outside")
    }
    # The expert axis over several hosts is inner in the mesh: each device's host by name.
    where = slices_lib.slice_of(result.run.ctx.mesh.devices, result.num_slices)
    slices = hlo_tools.slice_traffic(module, result.num_slices, module.num_devices, where)
    row["cross_slice"] = slices["cross_slice"] if result.num_slices > 1 else None
    # Gradient reductions inside a loop (float arrays of more than 8 elements): 0 when
    # every gradient is reduced once per step, after the pipeline loop.
    row["reductions_in_loop"] = sum(
        c.bytes * (c.multiplier or 1)
        for c in hlo_tools.collectives(module)
        if c.in_loop
        and c.kind in hlo_tools.REDUCTION_KINDS
        and c.elements > 8
        and not c.dtype.startswith(("s", "u", "pred"))
    )
    return row


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def _cells(label: str, row: dict) -> list[str]:
    if "error" in row:
        need = re.search(r"temporaries \(([\d.]+G)\)", row["error"])
        if need:  # XLA's refusal: the step's temporaries alone exceed the chip's HBM
            said = f"does not fit: XLA's HLO temporaries need {need.group(1)} (RESOURCE_EXHAUSTED)"
            return [label, "", said] + [""] * 5
        return [label, "fails: " + row["error"][:200]] + [""] * 6
    fits = "fits" if row["memory_bytes"] <= row["hbm_bytes"] else "DOES NOT FIT"
    inside, outside = (
        ", ".join(f"{k} {bl.mib(b)}" for k, b in sorted(row["kinds"][where].items()) if b)
        for where in ("in_loop", "outside")
    )
    cross = row["cross_slice"]
    return [
        label,
        row["mesh"],
        f"{_gib(row['memory_bytes'])} of {_gib(row['hbm_bytes'])} ({fits})",
        inside,
        outside,
        f"{bl.mib(cross['in_loop'])} / {bl.mib(cross['outside'])}" if cross else "-",
        bl.mib(row["reductions_in_loop"]),
        f"{row['compile_s']:.0f}",
    ]


def main() -> int:
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    os.makedirs(CACHE, exist_ok=True)
    rows = {}
    for label, layout in ROWS.items():
        if only in label:
            try:
                row = compile_row({**COMMON, **layout})
            except Exception as error:  # a layout that does not compile is reported, not fatal
                row = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
                row["tree"] = bl.revision()
            print(label, row, flush=True)
            with open(_cache_path(label), "w") as f:
                json.dump(row, f)
        if os.path.exists(_cache_path(label)):
            with open(_cache_path(label)) as f:
                rows[label] = json.load(f)
    lines = bl.header(
        "DeepSeek-V3's pipeline layout, compiled for 2048 chips (AOT, no device)",
        COMMAND,
        [
            "deepseek3-671b: 3 dense + 58 MoE layers, 16 stages (uneven: 4 slots a stage, "
            "6 of the 64 padding), bf16 weights, f32 optimizer state (ZeRO-1 over data), "
            "capacity_factor 1.25, remat full, GA=32 (the pipeline's 32 microbatches, "
            "bubble 15/47), one 4096-token sequence per batch shard per microbatch",
            "bytes per step per device, trip-count weighted (hlo_tools), by kind (a TPU "
            "program's hop to another slice is a megascale send, 'one-to-one'); 'gradient "
            "reductions in loops': all-reduce/reduce-scatter of float arrays inside any "
            "loop (0: every gradient reduced once per step, after the pipeline loop)",
            "the GA=16 row compiles the same layout with half the microbatches: the "
            "memory an extra pipeline microbatch costs (its activations: the layers' "
            "weights are picked inside their rematerialized call, model/pipeline.py, so "
            "no iteration keeps a copy of them; rows compiled before that tree kept the "
            "stage's weights once per iteration and did not fit)",
            "H100: DeepSeek-V3's 64-way expert parallelism over 8 hosts of 8 GPUs "
            "(dcn_expert_parallelism=8 x ici_expert_parallelism=8, one 'expert' mesh axis "
            "whose cross-host part is major); 'across slices/hosts' places each device by "
            "its host (trainer.sharding.slices.slice_of)",
            "compiled at " + ", ".join(dict.fromkeys(r.get("tree", "?") for r in rows.values())),
            *(f"{label}: {r['pipeline']}" for label, r in rows.items() if r.get("pipeline")),
        ],
    )
    lines += bl.table(
        [
            "layout",
            "mesh",
            "memory per device (GiB)",
            "in loops (MiB/step)",
            "outside loops (MiB/step)",
            "across slices/hosts, in loops / outside (MiB/step)",
            "gradient reductions in loops (MiB)",
            "compile s",
        ],
        [_cells(label, row) for label, row in rows.items()],
    )
    bl.write("aot_pipeline", lines, [{"layout": k, **v} for k, v in rows.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
