"""Expert-parallel all-to-all traffic per step: TPU v5e-8 and GPU h100-8 AOT programs.

tagtrain-test (16 experts, top-4, dtype=bfloat16) with GA=4 and
per_device_batch_size=1 on data=4 x expert=2 (the tokens sharded over the
expert axis, so routed rows travel in moe_kernels' padded all-to-all,
dispatch.routed_all_to_all), compiled on this CPU host for TPU v5e-8 (libtpu)
and for eight H100s (jax's CUDA plugin, deviceless), at capacity_factor 0 (no
cap: each (source, destination) block holds every assignment of its shard,
T*Z rows) and 1.0 (each block holds its fair share, T*Z/ep rows). Per compile:
the all-to-all bytes per optimizer step inside the accumulation loop and after
it (trip-count weighted, hlo_tools.traffic), the element types of the
all-to-alls that move rows (more than one element per row) and the rows per
block, read from the compiled HLO. Compiled, never run: no timings here.

Writes benchmarks/results/a2a_bytes.md and .csv. Needs the tpu and gpu extras:

    JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu python benchmarks/bench_a2a_bytes.py

About 1 min per compile on a 2-core host, 4 compiles.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time

# Another process (a test run) may hold libtpu; compile-only use can share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu python benchmarks/bench_a2a_bytes.py"
BASE = {
    "model_name": "tagtrain-test",
    "gradient_accumulation_steps": "4",
    "per_device_batch_size": "1",
    "ici_data_parallelism": "4",
    "ici_expert_parallelism": "2",
    "dtype": "bfloat16",
}
TOPOLOGIES = ("v5e-8", "h100-8")
CAPACITY_FACTORS = ("0", "1.0")


def measure(topology: str, cf: str) -> dict:
    import hlo_tools
    from trainer.config import make_config
    from trainer.run import aot

    overrides = {
        **BASE,
        "compile_topology": topology,
        "capacity_factor": cf,
        "base_output_directory": tempfile.mkdtemp(prefix="a2a_bytes_"),
    }
    start = time.perf_counter()
    result = aot.compile_for_topology(make_config(overrides))
    compile_s = time.perf_counter() - start
    module = hlo_tools.parse(result.compiled.as_text())
    records = [c for c in hlo_tools.collectives(module) if c.kind == "all-to-all"]
    flows = hlo_tools.traffic(records)
    d = result.run.config.emb_dim
    # The row payloads (dispatch and return): floating-point arrays whose last dim is
    # the model dim (the expert ids travel in their own s32 all-to-all).
    rows = [
        c
        for c in records
        if any(len(a.dims) > 1 and a.dims[-1] == d and a.dtype[0] in "bf" for a in c.arrays)
    ]
    dtypes = collections.Counter(c.dtype for c in rows)
    blocks = sorted({_block_rows(a, result.run) for c in rows for a in c.arrays if a.dims})
    return {
        "topology": topology,
        "capacity_factor": cf,
        "in_loop_bytes": flows["in_loop"].get("all-to-all", {}).get("bytes_per_step", 0),
        "outside_bytes": flows["outside"].get("all-to-all", {}).get("bytes_per_step", 0),
        "row_a2a_count": len(rows),
        "row_dtypes": " ".join(f"{t} x{n}" for t, n in sorted(dtypes.items())),
        "rows_per_block": " ".join(map(str, blocks)),
        "exact": flows["exact"],
        "compile_s": round(compile_s, 1),
        "tree": bl.revision(),
    }


def _block_rows(array, run) -> int:
    """Rows per (source, destination) block: the payload's rows over the expert axis size."""
    ep = dict(run.ctx.mesh.shape).get("expert", 1)
    n_rows = 1
    for x in array.dims[:-1]:
        n_rows *= x
    return n_rows // ep


def page(rows: list[dict]) -> list[str]:
    notes = [
        "model: tagtrain-test (emb 256, 16 experts, top-4, 4 layers of which MoE as "
        "configured), dtype=bfloat16, GA=4, per_device_batch_size=1 (128 tokens per "
        "device per microbatch), data=4 x expert=2",
        bl.accumulation_note(),
        f"run: {len(rows)} compiles, {sum(r['compile_s'] for r in rows) / 60:.1f} min",
    ]
    lines = bl.header("Expert-parallel all-to-all bytes per step (AOT)", COMMAND, notes)
    lines += [
        "All-to-all bytes per optimizer step on one device, trip-count weighted "
        "(hlo_tools.traffic), inside the accumulation loop and after it. The row "
        "all-to-alls are those whose payload's last dim is the model dim (dispatch "
        "and return, forward and backward); their element types as compiled, and the "
        "rows each (source, destination) block holds. capacity_factor=0: nothing can "
        "drop, so each block is sized for all T*Z assignments of its source shard; "
        "1.0: each block holds ceil(T*Z/ep) rows and overflow is dropped (and "
        "reported, moe/dropped_share). Bytes are the payload each device hands the "
        "collective; (ep-1)/ep of it leaves the device.",
        "",
        "Element type: the routed rows are cast to the compute dtype before the "
        "dispatch (layer.py: x arrives in `dtype`, the trainer's residual stream), so "
        "both programs move bf16 rows; only the f32 combine after the return "
        "all-to-all is wider. An 8-device CPU program of the same dispatch lowers "
        "the all-to-alls in bf16 and XLA's CPU backend widens them to f32 while "
        "optimizing (it has no bf16 collectives): the f32 seen there is the CPU "
        "backend's, not what TPU or GPU send.",
        "",
        "Before/after: at e2083d7 (before this page's hlo_tools fix) "
        "hlo_tools counted GPU all-to-all-start's (operands, output) tuple twice, so "
        "the h100-8 rows read 50,429,952 (cf 0) and 25,214,976 (cf 1.0) bytes per "
        "step; the TPU program was counted right. The dispatch code moved no bytes "
        "between the two measurements: the capacity cap is the change, its rows below.",
        "",
    ]
    lines += bl.table(
        [
            "topology",
            "capacity_factor",
            "all-to-all B/step in loop",
            "after loop",
            "row all-to-alls",
            "element types",
            "rows per block",
        ],
        [
            [
                r["topology"],
                r["capacity_factor"],
                f"{r['in_loop_bytes']:,}",
                f"{r['outside_bytes']:,}",
                r["row_a2a_count"],
                r["row_dtypes"],
                r["rows_per_block"],
            ]
            for r in rows
        ],
        align="llrrrll",
    )
    return lines


def main() -> int:
    import importlib.util

    missing = [p for p in ("libtpu", "jax_plugins.xla_cuda12") if not importlib.util.find_spec(p)]
    if missing:
        print(f"bench_a2a_bytes: skipped, needs {', '.join(missing)} (--extra tpu --extra gpu)")
        return 0
    topologies = os.environ.get("A2A_TOPOLOGIES", ",".join(TOPOLOGIES)).split(",")
    rows = []
    for topology in topologies:
        for cf in CAPACITY_FACTORS:
            rows.append(measure(topology, cf))
            print({k: v for k, v in rows[-1].items() if k != "tree"}, flush=True)
    bl.write("a2a_bytes", page(rows), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
