"""Fused gradient accumulation and the overlapped last-microbatch reduction: v5e-8 AOT.

deepseek3-small (24 layers, 16 experts), ZeRO-1, GA=4, one 1024-token sequence per
device per microbatch, remat full, compiled on this CPU host for TPU v5e-8
(data=8) in auto mode and in explicit mode: deferred (today's default), fused
(gradient_accumulation_schedule=fused: each layer's gradient added into the accumulator
inside the backward layer scan), overlap (gradient_accumulation_schedule=overlapped: the last
microbatch after the loop, each layer's gradient reduced inside its backward layer
scan), and fused / overlap with accum_dtype=bfloat16. Then two v5e-8 slices over
DCN (dcn_data=2 x data=8): auto, deferred, hierarchical and hierarchical + fused.

Per row: per-device memory (compiled.memory_analysis(), the figure aot_scale.md
reports) with its argument / output / alias / temp split; gradient reduction bytes
per step (trip-count weighted) inside the microbatch loop (hlo_tools
in_loop_reductions), in the last microbatch's backward layer scan
(overlapped_reductions) and after the loops (gradient_reductions_outside); and,
from the compiled TPU schedule (hlo_tools async_overlap / overlap_summary), the
share of gradient reduction bytes issued asynchronously with compute scheduled
between start and done.

Writes benchmarks/results/aot_fused.md and .csv. Needs libtpu (the `tpu` extra):

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_fused.py

Each compile's HLO and memory figures are kept under $TMPDIR/bench_aot_fused/;
`--reuse` reads them from there instead of compiling again (the analysis reruns).
`--short` leaves out the rows in OPTIONAL (the bf16 overlap row and the two-slice
deferred row), for when the whole run would take too long; the page says so.
A variant that fails to compile is a row with its error, not a crash.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time

# Another process (a test run) may hold libtpu; compile-only use can share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_fused.py"
COMMON = {
    "model_name": "deepseek3-small",
    "per_device_batch_size": "1",  # one 1024-token sequence per device per microbatch
    "remat_policy": "full",
    "compile_topology": "v5e-8",
    "ici_data_parallelism": "8",
    "shard_optimizer_over_data": "true",
    "gradient_accumulation_steps": "4",
}
BF16 = {"accum_dtype": "bfloat16"}
FUSED = {"gradient_accumulation_schedule": "fused"}
# The per-microbatch gradient path (fused accumulation is the default).
UNFUSED = {"gradient_accumulation_schedule": "plain"}
OVERLAP = {"gradient_accumulation_schedule": "overlapped"}
ONE_SLICE = {
    "auto": {"shard_mode": "auto"},
    "deferred": {"gradient_reduction_policy": "deferred", **UNFUSED},
    "fused": {"gradient_reduction_policy": "deferred", **FUSED},
    "overlap": {"gradient_reduction_policy": "deferred", **OVERLAP},
    "fused, bf16 accum": {"gradient_reduction_policy": "deferred", **FUSED, **BF16},
    "overlap, bf16 accum": {"gradient_reduction_policy": "deferred", **OVERLAP, **BF16},
}
TWO_SLICES = {"compile_topology_num_slices": "2", "dcn_data_parallelism": "2"}
SLICES = {
    "auto": {**TWO_SLICES, "shard_mode": "auto"},
    "deferred": {**TWO_SLICES, "gradient_reduction_policy": "deferred", **UNFUSED},
    "hierarchical": {**TWO_SLICES, "gradient_reduction_policy": "hierarchical", **UNFUSED},
    "hierarchical, fused": {**TWO_SLICES, "gradient_reduction_policy": "hierarchical", **FUSED},
}
# Left out by --short (each compile takes minutes on a loaded 2-core host).
OPTIONAL = {("v5e-8", "overlap, bf16 accum"), ("2 x v5e-8", "deferred")}
CACHE = os.path.join(tempfile.gettempdir(), "bench_aot_fused")


def compile_variant(slug: str, variant: dict, reuse: bool) -> dict:
    """{"hlo", "memory", "hbm", "slices", "params", "data", "compile_s", "tree"}; cached
    under CACHE (tree: `git describe` when the compile ran)."""
    from trainer.config import make_config
    from trainer.run import aot

    meta_path, hlo_path = (os.path.join(CACHE, f"{slug}.{ext}") for ext in ("json", "hlo"))
    if reuse and os.path.exists(meta_path):
        with open(meta_path) as f:
            return json.load(f)
    config = make_config({**COMMON, **variant, "base_output_directory": tempfile.mkdtemp()})
    os.makedirs(CACHE, exist_ok=True)
    tree = bl.revision()
    start = time.perf_counter()
    result = aot.compile_for_topology(config, hlo_path)
    meta = {
        "hlo": hlo_path,
        "memory": result.memory,
        "hbm": result.hbm_bytes,
        "slices": result.num_slices,
        "params": int(sum(x.size for x in jax.tree.leaves(result.run.state["params"]))),
        "data": dict(result.run.ctx.mesh.shape)["data"],
        "compile_s": time.perf_counter() - start,
        "tree": tree,
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return meta


def _floating(c) -> bool:
    # The router's s32 token counts are not gradients (as in aot_scale.md).
    return not c.dtype.startswith(("s", "u", "pred"))


def _per_step(records, data: int) -> tuple[int, int, bool]:
    """Trip-count weighted bytes per step: (payload, reduced operand, exact).

    payload: hlo_tools' bytes (a collective's result; a reduce-scatter's is its
    1/group shard); reduced operand: the bytes each device feeds the reduction
    (a reduce-scatter's payload x its group size; a ring reduce-scatter's
    permutes, n-1 shards for n shards fed in, x data/(data-1): these rows ring
    over 'data'), which counts a gradient the same whether XLA reduces it by
    all-reduce, reduce-scatter or ring. exact is False when a trip count is
    unknown (such records count once).
    """
    import hlo_tools

    payload = operand = 0
    exact = True
    for c in records:
        times = c.multiplier
        if times is None:
            exact, times = False, 1
        payload += c.bytes * times
        if hlo_tools.is_ring_reduction(c):
            operand += c.bytes * times * data // (data - 1)
        else:
            operand += c.bytes * times * (c.group_size if c.kind == "reduce-scatter" else 1)
    return payload, operand, exact


def measure(slug: str, variant: dict, reuse: bool) -> dict:
    import hlo_tools

    try:
        meta = compile_variant(slug, variant, reuse)
    except Exception as error:  # noqa: BLE001 - a failed variant is a row, not a crash
        text = str(error).strip().splitlines()
        return {"error": f"{type(error).__name__}: {(text[0] if text else '')[:300]}"}
    with open(meta["hlo"]) as f:
        module = hlo_tools.parse(f.read())
    in_loop = [c for c in hlo_tools.in_loop_reductions(module) if _floating(c)]
    overlapped = [c for c in hlo_tools.overlapped_reductions(module) if _floating(c)]
    after = [c for c in hlo_tools.gradient_reductions_outside(module) if _floating(c)]
    (in_b, in_o, e1), (ov_b, ov_o, e2), (af_b, af_o, e3) = (
        _per_step(x, meta["data"]) for x in (in_loop, overlapped, after)
    )
    schedule = [
        r
        for r in hlo_tools.async_overlap(module)
        if hlo_tools.is_gradient_reduction(r.collective) and _floating(r.collective)
    ]
    summary = hlo_tools.overlap_summary(schedule)
    mem = meta["memory"]
    return {
        "params": meta["params"],
        "data": meta["data"],
        "slices": meta["slices"],
        "compile_s": round(meta["compile_s"], 1),
        "tree": meta.get("tree", "unknown"),
        "memory_bytes": mem["total"],
        "argument_bytes": mem["argument"],
        "output_bytes": mem["output"],
        "alias_bytes": mem["alias"],
        "temp_bytes": mem["temp"],
        "peak_bytes": mem.get("peak"),
        "fits": mem["total"] <= meta["hbm"],
        "in_loop_ops": len(in_loop),
        "in_loop_bytes_per_step": in_b,
        "overlapped_ops": len(overlapped),
        "overlapped_bytes_per_step": ov_b,
        "after_ops": len(after),
        "after_bytes_per_step": af_b,
        "total_reduction_bytes_per_step": in_b + ov_b + af_b,
        "in_loop_operand_bytes_per_step": in_o,
        "overlapped_operand_bytes_per_step": ov_o,
        "after_operand_bytes_per_step": af_o,
        "total_operand_bytes_per_step": in_o + ov_o + af_o,
        "f32_gradient_bytes": meta["params"] * 4,
        "bytes_exact": e1 and e2 and e3,
        "schedule_ops": summary["count"],
        "async_ops": summary["async"],
        "overlapped_async_ops": summary["overlapped"],
        "async_bytes_per_step": summary["async_bytes_per_step"],
        "overlapped_async_bytes_per_step": summary["overlapped_bytes_per_step"],
        "async_overlap_share": summary["share"],
        "wire_bytes_per_step": summary["wire_bytes_per_step"],
        "overlapped_wire_bytes_per_step": summary["overlapped_wire_bytes_per_step"],
        "wire_overlap_share": summary["wire_share"],
    }


# The table's columns: _memory_cells and _reduction_cells fill them, in this order.
MEMORY_COLUMNS = ["GiB/device", "/ auto", "argument", "output", "temp", "peak live GiB"]
REDUCTION_COLUMNS = [
    "in loop MiB/step (ops)",
    "overlapped MiB/step (ops)",
    "after MiB/step (ops)",
    "total MiB/step",
    "reduced operand MiB/step",
    "x f32 grad",
    "operand / deferred",
    "async-overlapped share",
    "of wire bytes",
]


def gib(x: float) -> str:
    return f"{x / bl.GIB:.2f}"


def _memory_cells(r: dict, auto: dict | None) -> list[str]:
    return [
        f"{gib(r['memory_bytes'])}{'' if r['fits'] else ' (over 16 GiB)'}",
        f"{r['memory_bytes'] / auto['memory_bytes']:.2f}" if auto else "",
        gib(r["argument_bytes"]),
        gib(r["output_bytes"]),
        gib(r["temp_bytes"]),
        "" if r.get("peak_bytes") is None else gib(r["peak_bytes"]),
    ]


def _reduction_cells(r: dict, deferred: dict | None) -> list[str]:
    operand = r["total_operand_bytes_per_step"]
    ratio = f"{operand / deferred['total_operand_bytes_per_step']:.3f}" if deferred else ""
    share = r["async_overlap_share"]
    plus = "" if r["bytes_exact"] else "+"
    return [
        f"{bl.mib(r['in_loop_bytes_per_step'])} ({r['in_loop_ops']})",
        f"{bl.mib(r['overlapped_bytes_per_step'])} ({r['overlapped_ops']})",
        f"{bl.mib(r['after_bytes_per_step'])} ({r['after_ops']})",
        bl.mib(r["total_reduction_bytes_per_step"]) + plus,
        bl.mib(operand) + plus,
        f"{operand / r['f32_gradient_bytes']:.3f}",
        ratio,
        ("-" if share is None else f"{100 * share:.1f}%")
        + f" ({r['async_ops']} of {r['schedule_ops']} async)",
        "-" if r.get("wire_overlap_share") is None else f"{100 * r['wire_overlap_share']:.1f}%",
    ]


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_aot_fused: skipped, needs libtpu (uv run --extra tpu ...)")
        return 0
    reuse = "--reuse" in sys.argv[1:]
    short = "--short" in sys.argv[1:]
    started = time.perf_counter()
    rows = []
    for table, variants in (("v5e-8", ONE_SLICE), ("2 x v5e-8", SLICES)):
        for name, variant in variants.items():
            if short and (table, name) in OPTIONAL:
                continue
            slug = f"{table}_{name}".replace(", ", "_").replace(" ", "_")
            row = {"topology": table, "variant": name, **measure(slug, variant, reuse)}
            print(row, flush=True)
            rows.append(row)
    wall = time.perf_counter() - started

    def find(table: str, name: str) -> dict | None:
        return next(
            (
                r
                for r in rows
                if r["topology"] == table and r["variant"] == name and "error" not in r
            ),
            None,
        )

    auto, deferred = find("v5e-8", "auto"), find("v5e-8", "deferred")
    params = next((r["params"] for r in rows if "params" in r), None)
    excess = 7 / 8 * params * 4 if params else None
    bound = auto["memory_bytes"] + excess if auto and excess else None
    lines = bl.header(
        "Fused gradient accumulation and overlapped reduction: TPU v5e-8 AOT",
        COMMAND + "".join(f" {a}" for a in sys.argv[1:] if a in ("--short", "--reuse")),
        [
            "deepseek3-small"
            + (f" ({params / 1e9:.3f}B params)" if params else "")
            + ", ZeRO-1 (shard_optimizer_over_data), GA=4, 1 x 1024 tokens per device "
            "per microbatch, remat full, bf16 compute, f32 weights; v5e-8: data=8 over "
            "v5e:2x4; 2 x v5e-8: dcn_data=2 x data=8 (16 chips)",
            "memory: compiled.memory_analysis() per device, total = argument + output - "
            "alias + temp + code (aot_scale.md's memory MiB/device); peak live = XLA's "
            "peak of simultaneously live buffers (memory_analysis().peak_memory_in_bytes, "
            "arguments included), what the temp allocation reserves beyond it aside",
            "gradient reductions: all-reduce/reduce-scatter, cross-replica, over > 8 "
            "floating elements, and overlapped_ring's collective-permutes "
            "(hlo_tools.is_ring_reduction); MiB per step per device, trip-count weighted, (ops); "
            "in loop = hlo_tools.in_loop_reductions (the microbatch loop and the scans "
            "inside it), overlapped = hlo_tools.overlapped_reductions (the last "
            "microbatch's backward layer scan, after the microbatch loop), after = "
            "hlo_tools.gradient_reductions_outside; these count hlo_tools' payload (a "
            "reduce-scatter's 1/8 result shard, an all-reduce's full result); reduced "
            "operand = what each device feeds the reductions (reduce-scatter payload x 8), "
            "the same for a gradient whichever form XLA picks; x f32 grad = that over "
            "params x 4 B (1.000: each gradient reduced once per step, in f32)",
            "async overlap: hlo_tools.async_overlap on the compiled (scheduled) TPU module: "
            "the share of gradient reduction bytes per step issued by an async start with "
            "compute scheduled between start and done (overlap_summary's share); of wire "
            "bytes = the same share of hlo_tools.wire_bytes (what each device sends by the "
            "ring algorithm: all-reduce 2 x 7/8 of its array, reduce-scatter 7 shards, a "
            "permute its array), which weighs a gradient alike whichever collective "
            "reduces it",
            f"run: {len(rows)} compiles, "
            f"{sum(r.get('compile_s', 0) for r in rows) / 60:.1f} min of compile time "
            "(compile_s per row in the csv); compiled at "
            + ", ".join(dict.fromkeys(r["tree"] for r in rows if "tree" in r))
            + (f"; this analysis pass {wall / 60:.1f} min, reading cached HLO" if reuse else "")
            + (
                "; --short: left out "
                + " and ".join(f"{name} ({table})" for table, name in sorted(OPTIONAL))
                if short
                else ""
            ),
        ],
    )
    lines += ["## One slice: v5e-8, data=8", ""]
    mem_cols, red_cols = MEMORY_COLUMNS, REDUCTION_COLUMNS
    ncols = 1 + len(mem_cols) + len(red_cols)
    table_rows = []
    for r in rows:
        if r["topology"] != "v5e-8":
            continue
        if "error" in r:
            table_rows.append([r["variant"], f"fails: {r['error']}"] + [""] * (ncols - 2))
            continue
        table_rows.append([r["variant"], *_memory_cells(r, auto), *_reduction_cells(r, deferred)])
    lines += bl.table(["variant", *mem_cols, *red_cols], table_rows, align="l" + "r" * (ncols - 1))
    lines += [""]
    if bound is not None:
        lines.append(
            f"Targets (issue #14): memory <= auto + 7/8 x params x 4 B = "
            f"{gib(auto['memory_bytes'])} + {gib(excess)} = {gib(bound)} GiB (the f32 "
            "accumulator's inherent excess over auto); accum_dtype=bfloat16 lower still; "
            "each gradient reduced once per step: reduced operand bytes = deferred's "
            "(operand / deferred 1.000; bf16 accumulation reduces in bf16, 0.5x); "
            "async-overlapped share >= 90%."
        )
        lines.append("")
        verdicts = []
        for r in rows:
            if r["topology"] == "v5e-8" and "error" not in r and r["variant"] != "auto":
                ok = "meets" if r["memory_bytes"] <= bound else "misses"
                verdicts.append(f"{r['variant']} {gib(r['memory_bytes'])} ({ok})")
        lines.append("Memory against the bound: " + "; ".join(verdicts) + ".")
        lines.append("")
    lines += [
        "The async share is what the compiled schedule shows, not a projection: this "
        "libtpu's TPU compile from a CPU host keeps in-slice all-reduce and "
        "reduce-scatter synchronous (docs/hlo_tools.md), wherever they sit; on two slices "
        "the asynchronous ones are the cross-slice (megascale DCN) reductions, each with "
        "compute scheduled between start and done.",
        "",
        "## Two slices: 2 x v5e-8, dcn_data=2 x data=8",
        "",
    ]
    auto2 = find("2 x v5e-8", "auto")
    deferred2 = find("2 x v5e-8", "deferred")
    table_rows = []
    for r in rows:
        if r["topology"] != "2 x v5e-8":
            continue
        if "error" in r:
            table_rows.append([r["variant"], f"fails: {r['error']}"] + [""] * (ncols - 2))
            continue
        table_rows.append([r["variant"], *_memory_cells(r, auto2), *_reduction_cells(r, deferred2)])
    lines += bl.table(["variant", *mem_cols, *red_cols], table_rows, align="l" + "r" * (ncols - 1))
    lines += [
        "",
        "Target (issue #13): hierarchical memory <= 1.05x auto's. Hierarchical reduces "
        "the in-slice axis per microbatch by design (GA x the in-slice bytes, in the "
        "loop), the cross-slice axis once per step; the reduction columns add in-slice "
        "and cross-slice together (bench_aot_slices.py splits them).",
    ]
    if auto2:
        verdicts = []
        for r in rows:
            if r["topology"] == "2 x v5e-8" and "error" not in r and r["variant"] != "auto":
                x = r["memory_bytes"] / auto2["memory_bytes"]
                verdicts.append(f"{r['variant']} {x:.2f}x ({'meets' if x <= 1.05 else 'misses'})")
        lines += ["", "Memory against 1.05x auto: " + "; ".join(verdicts) + "."]
    bl.write("aot_fused", lines, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
