"""Explicit vs auto sharding on issue 7's layouts, 8 CPU devices, timed side by side.

The layouts of packages/trainer/tests/test_aot_matrix.py (data, fsdp, fsdp+tensor,
fsdp+tensor_transpose, fsdp+context, fsdp+expert with the fsdp and context
options, data+expert, data+ZeRO-1, data+fsdp), each in shard_mode=explicit and
auto, on a tagtrain-tiny-derived model (6 layers, 16 experts, f32) with GA=4 and
one 32-token sequence per device per microbatch. All compiled steps are timed in
one run, interleaved (each round steps every configuration once); reported is
the median of the rounds after warm-up. Also per device: compiled memory and
collective bytes per step (all kinds, in loops and outside).

Writes benchmarks/results/explicit_auto.md, .csv and explicit_auto.png:

    JAX_PLATFORMS=cpu uv run python benchmarks/bench_explicit_auto.py
"""

from __future__ import annotations

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

EIGHT_DEVICE_LAYOUTS = bl.trainer_test_module("layouts").EIGHT_DEVICE_LAYOUTS

import pspec_tags as pt  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run python benchmarks/bench_explicit_auto.py"
WARMUP = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
MODEL = {
    "model_name": "tagtrain-tiny",
    "dtype": "float32",
    "base_num_decoder_layers": "6",
    "num_experts": "16",
    "gradient_accumulation_steps": "4",
    "per_device_batch_size": "1",
}
MODES = pt.MODES


def deferred_share(step: bl.TrainerStep) -> float:
    """Fraction of the gradient elements whose reduction explicit mode defers.

    A parameter defers the deferral axes that do not shard it: under FSDP only
    the small unsharded leaves (norm scales, say) defer anything, so there is
    little for deferral to save."""
    import jax

    import pspec_tags as pt

    axes = set(step.run.deferral_axes)
    # ZeRO-1 masters are sharded over 'data'; the loop's compute copies are not.
    master_only = {"data"} if step.config.shard_optimizer_over_data else set()
    total = deferred = 0
    for leaf in jax.tree.leaves(step.run.state["params"]):
        total += leaf.size
        if axes - (set(pt.mesh_axes_used(leaf.sharding.spec)) - master_only):
            deferred += leaf.size
    return deferred / total if total else 0.0


def main() -> None:
    layouts = EIGHT_DEVICE_LAYOUTS
    steps, failed = bl.compile_steps(
        {
            (name, mode): {**MODEL, **layout, "shard_mode": mode}
            for name, layout in layouts.items()
            for mode in MODES
        }
    )
    samples = bl.interleaved({k: s.step for k, s in steps.items()}, WARMUP, ROUNDS)
    med = {k: bl.median(v) for k, v in samples.items()}
    rows = []
    for name in layouts:
        row = {"layout": name}
        for mode in MODES:
            s = steps.get((name, mode))
            if s is None:
                row[f"{mode}_error"] = failed[name, mode][:300]
                continue
            row.update(
                {
                    f"{mode}_s": med[name, mode],
                    f"{mode}_memory_bytes": s.memory["total"],
                    f"{mode}_in_loop_bytes": s.bytes("in_loop"),
                    f"{mode}_outside_bytes": s.bytes("outside"),
                    f"{mode}_deferral": ",".join(s.run.deferral_axes) if mode == "explicit" else "",
                }
            )
            if mode == "explicit":
                row["deferred_share"] = deferred_share(s)
        if "explicit_s" in row and "auto_s" in row:
            row["auto_over_explicit"] = row["auto_s"] / row["explicit_s"]
            row["memory_ratio"] = row["explicit_memory_bytes"] / row["auto_memory_bytes"]
        rows.append(row)
    write(rows)


def _verdict(row) -> str:
    if "auto_over_explicit" not in row:
        return "no comparison"
    r = row["auto_over_explicit"]
    # The 1.10x target is for layouts where deferral covers most gradient bytes.
    deferral = row.get("deferred_share", 0.0) > 0.5
    if deferral:
        return "meets (>= 1.10x)" if r >= 1.10 else "misses 1.10x"
    return "meets (>= 0.97x)" if r >= 0.97 else "misses 0.97x"


def write(rows) -> None:
    lines = bl.header(
        "Explicit vs auto sharding on the parallelism layouts (8 CPU devices)",
        COMMAND,
        [
            "model: tagtrain-tiny with 6 layers (1 dense + 5 MoE), 16 experts (top-2), "
            "emb 64, f32; GA=4, one sequence x 32 tokens per device per microbatch",
            f"median of {ROUNDS} steady steps after {WARMUP} warm-up rounds, all "
            "configurations interleaved in each round",
            bl.accumulation_note(),
            "bytes: collective payload per device per step, all kinds, weighted by loop "
            "trip counts; memory: compiled memory analysis per device",
            "targets (issue 9): explicit no more than 3% slower than auto anywhere "
            "(auto/explicit >= 0.97), >= 1.10x faster where deferral applies: read here as "
            "where it covers most (> 50%) of the gradient elements. Weights sharded over a "
            "token axis (FSDP, experts over 'expert') reduce over it per microbatch in both "
            "modes; only their other token axes defer",
        ],
    )
    table_rows = []
    for r in rows:
        if "auto_over_explicit" not in r:
            err = r.get("explicit_error") or r.get("auto_error") or ""
            table_rows.append([r["layout"], f"fails: {err[:150]}"] + [""] * 7)
            continue
        table_rows.append(
            [
                r["layout"],
                f"{r['explicit_deferral'] or '-'} ({r['deferred_share']:.0%})",
                f"{r['explicit_s'] * 1e3:.1f}",
                f"{r['auto_s'] * 1e3:.1f}",
                f"{r['auto_over_explicit']:.3f}x",
                f"{r['memory_ratio']:.3f}",
                f"{bl.mib(r['explicit_in_loop_bytes'])} / {bl.mib(r['explicit_outside_bytes'])}",
                f"{bl.mib(r['auto_in_loop_bytes'])} / {bl.mib(r['auto_outside_bytes'])}",
                _verdict(r),
            ]
        )
    lines += bl.table(
        [
            "layout",
            "explicit defers over (share of gradient elements)",
            "explicit ms",
            "auto ms",
            "auto / explicit",
            "memory explicit / auto",
            "explicit MiB/step in loop / outside",
            "auto",
            "target",
        ],
        table_rows,
        align="llrrrrrrl",
    )
    lines += [
        "",
        "CPU collectives are in-process copies between virtual devices sharing 2 cores:",
        "communication is cheap next to compute, so traffic savings show up weakly in step",
        "time, and a few percent of noise remains even interleaved. The byte columns are",
        "exact (from the compiled HLO) and carry over to accelerators; the times do not.",
        "",
        "![explicit vs auto](explicit_auto.png)",
    ]
    bl.write("explicit_auto", lines, rows)
    ok = [r for r in rows if "auto_over_explicit" in r]
    bl.plot_bars(
        os.path.join(bl.RESULTS, "explicit_auto.png"),
        "step time, 8 CPU devices, GA=4 (lower is better)",
        [r["layout"] for r in ok],
        {m: [r[f"{m}_s"] * 1e3 for r in ok] for m in MODES},
        "ms per step",
    )


if __name__ == "__main__":
    main()
