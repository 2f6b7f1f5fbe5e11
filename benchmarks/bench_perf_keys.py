"""What each performance config key changes in the compiled TPU program: v5e-8 AOT.

deepseek3-small, ZeRO-1 (shard_optimizer_over_data), GA=4, one 1024-token
sequence per device per microbatch, remat full, compiled on this CPU host for
TPU v5e-8 (data=8) as bench_aot_fused.py compiles it. Each row flips one key
against a base row and records what the compiled program shows: per-device
memory (total and peak live), the count of each collective kind, gradient
reduction bytes per step in the microbatch loop, the async-overlapped share of
gradient reduction bytes (hlo_tools.async_overlap / overlap_summary), and
whether the compiled (scheduled) module is its base's, instruction for instruction
(program_lines: the computations' text without metadata).

Two bases: the issue #35 recipe (deferred,
gradient_accumulation_schedule=overlapped_ring, tpu_async_collectives) and the
trainer's defaults with gradient_reduction_policy=deferred (one compile per row: auto may compile
several policies).

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_perf_keys.py [--reuse] [--first N]

Writes benchmarks/results/perf_keys.md and .csv, after every compile (a run cut
short keeps its rows; the page names the rows not compiled). Compiles are cached
under $TMPDIR/bench_aot_fused/ (slugs perf_*); `--reuse` reads them back by slug,
whatever tree they were compiled at (the page names a row's and its base's trees
where they differ: the program difference then includes the code changes).
`--first N` compiles only the first N of ROWS (priority order).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import re
import sys
import time

import bench_aot_fused as fused  # noqa: E402 - sets up jax and the compile cache
import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_perf_keys.py"
DEFERRED = {"gradient_reduction_policy": "deferred"}
RECIPE = {
    **DEFERRED,
    "gradient_accumulation_schedule": "overlapped_ring",
    "tpu_async_collectives": "true",
}
DEFAULTS = dict(DEFERRED)
# Base name -> its overrides (on top of bench_aot_fused.COMMON).
BASES = {"recipe": RECIPE, "defaults": DEFAULTS}
# Rows in priority order (--first N compiles the first N), each (key flipped, base,
# value); a base row flips nothing ("", base, None). Each compile takes minutes.
ROWS = [
    ("", "recipe", None),
    ("tpu_async_collectives", "recipe", "false"),
    ("", "defaults", None),
    ("tpu_async_collectives", "defaults", "true"),
    ("remat_policy", "defaults", "minimal"),
    ("sparse_matmul", "defaults", "false"),
    ("accum_dtype", "defaults", "bfloat16"),
    ("gradient_accumulation_schedule", "recipe", "overlapped"),
    ("gradient_accumulation_schedule", "defaults", "overlapped"),
    ("gradient_accumulation_schedule", "defaults", "plain"),
    ("remat_policy", "defaults", "none"),
    ("scan_layers", "defaults", "false"),
]
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_METADATA = re.compile(r", metadata=\{[^}]*\}")
# A computation's first line: `%name (...) -> ... {` or `ENTRY %name ...`. What comes
# before it (module header, stack-frame tables) names the Python call stack, not the
# program.
_COMPUTATION = re.compile(r"^(ENTRY )?%\S+ ")


def program_lines(hlo_path: str) -> list[str]:
    """The compiled module's computations, line by line, without metadata: two
    compiles of the same program give the same lines in the same (scheduled) order."""
    with open(hlo_path) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if _COMPUTATION.match(line))
    return [_METADATA.sub("", line) for line in lines[start:]]


def fingerprint(lines: list[str]) -> str:
    """sha256 (12 hex digits) of `program_lines`."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def against_base(row_lines: list[str], base_lines: list[str]) -> str:
    """How a row's program differs from its base's: same, reordered only, or the
    count of instruction lines only in each."""
    if row_lines == base_lines:
        return "same program"
    here, there = collections.Counter(row_lines), collections.Counter(base_lines)
    if here == there:
        return "same instructions, another order"
    return f"differs: {sum((here - there).values())} lines only here, " + (
        f"{sum((there - here).values())} only in base"
    )


def collective_counts(hlo_path: str) -> dict[str, int]:
    """Collectives per kind in the compiled module (each instruction once, loops not
    weighted), and how many of them are asynchronous (hlo_tools.async_overlap: a
    -start form or a TPU async collective fusion)."""
    import hlo_tools

    with open(hlo_path) as f:
        module = hlo_tools.parse(f.read())
    seen = {}
    for record in hlo_tools.async_overlap(module):
        seen[(record.collective.computation, record.collective.name)] = record
    counts = collections.Counter(record.kind for record in seen.values())
    asynchronous = sum(1 for record in seen.values() if record.is_async)
    return {**{kind: counts.get(kind, 0) for kind in KINDS}, "async_collectives": asynchronous}


def measure_row(key: str, base: str, value: str | None, reuse: bool) -> dict:
    variant = dict(BASES[base])
    if value is not None:
        variant[key] = value
    slug = f"perf_{base}" + ("" if value is None else f"_{key}_{value}")
    row = {"base": base, "key": key if value else "", "value": value or "", "slug": slug}
    row.update(fused.measure(slug, variant, reuse))
    if "error" not in row:
        path = _hlo_path(row)
        row["fingerprint"] = fingerprint(program_lines(path))
        row.update(collective_counts(path))
    return row


def _counts_cell(r: dict) -> str:
    parts = [f"{kind} {r[kind]}" for kind in KINDS if r.get(kind)]
    return ", ".join(parts) + f"; {r['async_collectives']} async"


def _share(r: dict) -> str:
    share = r["async_overlap_share"]
    return "-" if share is None else f"{100 * share:.1f}%"


def _hlo_path(r: dict) -> str:
    return f"{fused.CACHE}/{r['slug']}.hlo"


def _row_cells(r: dict, base: dict | None) -> list[str]:
    if "error" in r:
        return [f"fails: {r['error']}"] + [""] * 7
    versus = ""
    if base is not None and "error" not in base:
        versus = against_base(program_lines(_hlo_path(r)), program_lines(_hlo_path(base)))
        versus += _tree_note(r, base)
    return [
        fused.gib(r["memory_bytes"]),
        "" if r.get("peak_bytes") is None else fused.gib(r["peak_bytes"]),
        _counts_cell(r),
        bl.mib(r["total_reduction_bytes_per_step"]),
        f"{bl.mib(r['in_loop_bytes_per_step'])} ({r['in_loop_ops']})",
        _share(r) + f" ({r['async_ops']} of {r['schedule_ops']} async)",
        r["fingerprint"],
        versus,
    ]


def _tree_note(r: dict, base: dict) -> str:
    """Names both trees where a row and its base were compiled from different package
    sources (--reuse reads a cached compile whatever tree it came from): the
    difference then holds the code changes between them as well as the key's."""
    if _same_source(r["tree"], base["tree"]):
        return ""
    return f" (compiled at {r['tree']}, base at {base['tree']})"


def _same_source(tree: str, other: str) -> bool:
    """Whether two `git describe --dirty` trees hold the same packages/ source. The
    -dirty mark is dropped: this script's runs dirty the tree only by writing their
    page (a cache compiled with edited source is then taken as its commit's)."""
    import subprocess

    commits = [t.removesuffix("-dirty") for t in (tree, other)]
    if commits[0] == commits[1]:
        return True
    diff = subprocess.run(
        ["git", "diff", "--quiet", *commits, "--", "packages"], cwd=bl.ROOT, check=False
    )
    return diff.returncode == 0


def _first(argv: list[str]) -> int:
    """--first N: how many ROWS to compile (all without it)."""
    if "--first" not in argv:
        return len(ROWS)
    return int(argv[argv.index("--first") + 1])


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_perf_keys: skipped, needs libtpu (uv run --extra tpu ...)")
        return 0
    argv = sys.argv[1:]
    reuse = "--reuse" in argv
    todo = ROWS[: _first(argv)]
    started = time.perf_counter()
    rows = []
    # The page is rewritten after every compile, so a run cut short keeps its rows.
    for key, base, value in todo:
        row = measure_row(key, base, value, reuse)
        print(row, flush=True)
        rows.append(row)
        _write_page(rows, argv, time.perf_counter() - started)
    return 0


def _write_page(rows: list[dict], argv: list[str], wall: float) -> None:
    """perf_keys.md and .csv from the rows compiled so far."""
    reuse = "--reuse" in argv
    done = {(r["key"], r["base"], r["value"] or None) for r in rows}
    left_out = [
        f"{k}={v} ({b})" if k else f"{b} (base)" for k, b, v in ROWS if (k, b, v) not in done
    ]
    flags = "".join(f" {a}" for a in argv if a == "--reuse")
    if "--first" in argv:
        flags += f" --first {_first(argv)}"
    bases = {r["base"]: r for r in rows if not r["key"]}
    lines = bl.header(
        "What each performance key changes in the compiled program: TPU v5e-8 AOT",
        COMMAND + flags,
        [
            "deepseek3-small, ZeRO-1 (shard_optimizer_over_data), GA=4, 1 x 1024 tokens per "
            "device per microbatch, remat full unless the row says otherwise, bf16 compute, "
            "f32 weights, v5e-8: data=8 over v5e:2x4",
            "bases: recipe = "
            + ", ".join(f"{k}={v}" for k, v in RECIPE.items())
            + "; defaults = the trainer's defaults with "
            + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
            + " ("
            + bl.accumulation_note()
            + ")",
            "memory: compiled.memory_analysis() per device (total; peak live buffers); "
            "collectives: instructions per kind in the compiled module, each once (loops "
            "not weighted), async = issued by an async start (hlo_tools.async_overlap); "
            "gradient reduction MiB/step = trip-count weighted payload of every gradient "
            "reduction (hlo_tools bytes: a reduce-scatter's is its 1/group shard, so compare "
            "rows of one schedule); in loop = gradient reduction "
            "MiB per step (ops) inside the microbatch loop (hlo_tools.in_loop_reductions); "
            "async-overlapped share = gradient reduction bytes per step issued by an async "
            "start with compute scheduled between start and done (as on aot_async.md)",
            "fingerprint: sha256 of the compiled module's computations without metadata "
            "(the stack-frame tables and module header left out: they name the Python "
            "call stack); against base: the same program (the same lines in the same "
            "scheduled order), the same instructions in another order, or how many "
            "instruction lines only each has",
            bl.compiles_note(rows, wall, reuse)
            + ("; not compiled in this run (time): " + ", ".join(left_out) if left_out else ""),
        ],
    )
    columns = [
        "GiB/device",
        "peak live GiB",
        "collectives",
        "gradient reduction MiB/step",
        "in-loop reduction MiB/step (ops)",
        "async-overlapped share",
        "fingerprint",
        "against base",
    ]
    table_rows = []
    for r in rows:
        label = f"{r['base']}" + (f": {r['key']}={r['value']}" if r["key"] else " (base)")
        base = bases.get(r["base"]) if r["key"] else None
        table_rows.append([label, *_row_cells(r, base)])
    lines += bl.table(["row", *columns], table_rows, align="l" + "r" * 6 + "ll")
    bl.write("perf_keys", lines, rows)


if __name__ == "__main__":
    sys.exit(main())
