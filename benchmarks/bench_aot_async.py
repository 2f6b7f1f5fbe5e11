"""Asynchronous gradient reductions in the compiled TPU schedule: v5e-8 and v6e-8 AOT.

deepseek3-small, GA=4, one 1024-token sequence per device per microbatch, remat
full, compiled on this CPU host with the trainer's TPU compile options
(`tpu_async_collectives=true`, trainer/run/xla_options.py: asynchronous all-reduce
collective fusions, no all-reduce combining). Rows: auto and
gradient_accumulation_schedule=overlapped (the last microbatch's per-layer reductions inside
its backward layer scan, pipelined by one layer and bucketed per layer) on v5e-8
with ZeRO-1 (the seed's recipe, aot_fused.md's rows), overlap on v6e-8 with and
without ZeRO-1 (all-reduces instead of reduce-scatters), and overlap on v5e-8 with
ZeRO-1 compiled without the options (their memory effect).

Per row, as on aot_fused.md (bench_aot_fused.measure): memory, gradient reduction
bytes per step inside / in the overlapped scan / after the loops, and the share of
gradient reduction bytes per step the schedule issues asynchronously with compute
scheduled between start and done (hlo_tools.async_overlap / overlap_summary).

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_async.py [--reuse]

Writes benchmarks/results/aot_async.md and .csv; compiles are cached as
bench_aot_fused's are (`--reuse` reads them back).
"""

from __future__ import annotations

import importlib.util
import sys
import time

import bench_aot_fused as fused  # noqa: E402 - sets up jax and the compile cache
import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_async.py"
ASYNC = {"tpu_async_collectives": "true"}
NO_ZERO1 = {"shard_optimizer_over_data": "false"}
V6E = {"compile_topology": "v6e-8"}
# ZeRO-1's per-layer reduce-scatters as rings of collective-permutes (accum/ring.py).
RING = {"gradient_accumulation_schedule": "overlapped_ring"}  # after OVERLAP: replaces it
OVERLAP = {"gradient_reduction_policy": "deferred", **fused.OVERLAP}
ROWS = {
    ("v5e-8, ZeRO-1", "auto"): {"shard_mode": "auto", **ASYNC},
    # Auto as issue #14 measured it, before fused accumulation became the default:
    # the bound's other reference.
    ("v5e-8, ZeRO-1", "auto, unfused"): {"shard_mode": "auto", **fused.UNFUSED, **ASYNC},
    # Fused accumulation without the overlap: the memory the overlap adds to.
    ("v5e-8, ZeRO-1", "fused"): {"gradient_reduction_policy": "deferred", **fused.FUSED, **ASYNC},
    ("v5e-8, ZeRO-1", "overlap"): {**OVERLAP, **ASYNC},
    ("v5e-8, ZeRO-1", "overlap, tpu_async_collectives=false"): OVERLAP,
    ("v5e-8, ZeRO-1", "overlap, ring_reduce_scatter"): {**OVERLAP, **ASYNC, **RING},
    ("v6e-8, ZeRO-1", "overlap"): {**V6E, **OVERLAP, **ASYNC},
    ("v6e-8, ZeRO-1", "overlap, ring_reduce_scatter"): {**V6E, **OVERLAP, **ASYNC, **RING},
    # Without ZeRO-1 the step needs about 19 GiB: over v5e's 16 GiB HBM, within v6e's 32.
    ("v6e-8, no ZeRO-1", "overlap"): {**V6E, **NO_ZERO1, **OVERLAP, **ASYNC},
}


# The auto rows issue #14's bound is read against: today's default, and auto as the
# issue measured it (fused accumulation changes auto's memory too).
BOUND_REFERENCES = ("auto", "auto, unfused")


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_aot_async: skipped, needs libtpu (uv run --extra tpu ...)")
        return 0
    reuse = "--reuse" in sys.argv[1:]
    started = time.perf_counter()
    rows = []
    for (where, name), variant in ROWS.items():
        slug = f"async_{where}_{name}".replace(", ", "_").replace(" ", "_")
        row = {"topology": where, "variant": name, **fused.measure(slug, variant, reuse)}
        print(row, flush=True)
        rows.append(row)
    wall = time.perf_counter() - started
    lines = bl.header(
        "Asynchronous gradient reductions in the compiled TPU schedule (AOT)",
        COMMAND + (" --reuse" if reuse else ""),
        [
            "deepseek3-small, GA=4, 1 x 1024 tokens per device per microbatch, remat full, "
            "bf16 compute, f32 weights, data=8; TPU compile options: tpu_async_collectives=true "
            "(trainer/run/xla_options.py) unless the row says false",
            bl.accumulation_note() + " (rows set their own keys on top)",
            "columns as on aot_fused.md; async-overlapped share = gradient reduction bytes "
            "per step issued by an async start with compute scheduled between start and done; "
            "of wire bytes = the same share of hlo_tools.wire_bytes (comparable across "
            "all-reduce, reduce-scatter and ring permutes)",
            bl.compiles_note(rows, wall, reuse),
        ],
    )
    auto = _v5e_row(rows, "auto")
    columns = [*fused.MEMORY_COLUMNS, *fused.REDUCTION_COLUMNS]
    table_rows = []
    for r in rows:
        label = f"{r['topology']}: {r['variant']}"
        if "error" in r:
            table_rows.append([label, f"fails: {r['error']}"] + [""] * (len(columns) - 1))
            continue
        # "/ auto": against v5e-8 ZeRO-1 auto; no deferred row here ("operand / deferred" blank).
        table_rows.append([label, *fused._memory_cells(r, auto), *fused._reduction_cells(r, None)])
    lines += bl.table(["row", *columns], table_rows, align="l" + "r" * len(columns))
    for reference in BOUND_REFERENCES:
        lines += _bound_lines(reference, rows)
    bl.write("aot_async", lines, rows)
    return 0


def _v5e_row(rows: list[dict], variant: str) -> dict | None:
    """The compiled (error-free) v5e-8 ZeRO-1 row named `variant`, if any."""
    return next(
        (
            r
            for r in rows
            if r["topology"] == "v5e-8, ZeRO-1" and r["variant"] == variant and "error" not in r
        ),
        None,
    )


def _bound_lines(reference: str, rows: list[dict]) -> list[str]:
    """Issue #14's memory bound for the v5e-8 ZeRO-1 rows: the `reference` auto row's
    memory plus the f32 accumulator's inherent excess (7/8 x params x 4 B), on the
    total and on the peak."""
    auto = _v5e_row(rows, reference)
    if auto is None:
        return []
    excess = 7 / 8 * auto["params"] * 4
    bound, peak_bound = auto["memory_bytes"] + excess, None
    if auto.get("peak_bytes"):
        peak_bound = auto["peak_bytes"] + excess
    lines = [
        "",
        f"Bound (issue #14) on {reference}: {reference} + 7/8 x params x 4 B = "
        f"{fused.gib(bound)} GiB per device"
        + (f"; on the peak live buffers {fused.gib(peak_bound)} GiB." if peak_bound else "."),
        "",
    ]
    for r in rows:
        if "error" in r or r["topology"] != "v5e-8, ZeRO-1" or r["variant"] in BOUND_REFERENCES:
            continue
        peak = r.get("peak_bytes")
        peak_text = (
            f", peak live {fused.gib(peak)} ({'meets' if peak <= peak_bound else 'misses'})"
            if peak and peak_bound
            else ""
        )
        verdict = "meets" if r["memory_bytes"] <= bound else "misses"
        lines.append(f"- {r['variant']}: {fused.gib(r['memory_bytes'])} GiB ({verdict}){peak_text}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
