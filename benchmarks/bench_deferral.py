"""Deferred vs per-microbatch gradient reduction in the trainer, one factor at a time.

The seed's "when the fix pays off" table on 8 virtual CPU devices (mesh data=8,
explicit): a tagtrain-tiny-derived base (6 layers, 16 experts, f32, one
32-token sequence per device per microbatch, GA=4), varying one factor at a time:
GA steps 1/2/4/8, sequences per device per microbatch 1/2/4, experts 8/16/32,
depth 3/6/12 layers. Every configuration is compiled twice (deferred and
gradient_reduction_policy=per_microbatch) and all are timed in one run, interleaved: each
round steps every configuration once; reported is the median of the rounds after
warm-up. Also from the compiled step: all-reduce/reduce-scatter bytes per step in
the loop and after it, and the compiled memory per device.

The GA sweep is fitted with T = o + N*c + {N*a per microbatch | a deferred};
the ceiling (c+a)/(c+a/N) and the fitted speedup (o+N(c+a))/(o+Nc+a) stand beside
the measured speedup. For the other factors (N=4 fixed) a comes from the pair,
a = (T_pm - T_def)/(N-1), and c from T_def with the GA sweep's o.

Writes benchmarks/results/deferral.md, .csv and deferral.png:

    JAX_PLATFORMS=cpu uv run python benchmarks/bench_deferral.py
"""

from __future__ import annotations

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run python benchmarks/bench_deferral.py"
WARMUP = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
BASE = dict(ga=4, rows=1, experts=16, layers=6)
FACTORS = {
    "ga": (1, 2, 4, 8),
    "rows": (1, 2, 4),
    "experts": (8, 16, 32),
    "layers": (3, 6, 12),
}
LABEL = {
    "ga": "GA steps",
    "rows": "sequences/device/microbatch",
    "experts": "experts",
    "layers": "layers",
}


def overrides(ga, rows, experts, layers, defer) -> dict[str, str]:
    return {
        "model_name": "tagtrain-tiny",
        "dtype": "float32",
        "ici_data_parallelism": "8",
        "gradient_accumulation_steps": str(ga),
        "per_device_batch_size": str(rows),
        "num_experts": str(experts),
        "base_num_decoder_layers": str(layers),
        "gradient_reduction_policy": "deferred" if defer else "per_microbatch",
    }


def points():
    seen = []
    for factor, values in FACTORS.items():
        for v in values:
            p = tuple(sorted({**BASE, factor: v}.items()))
            if p not in seen:
                seen.append(p)
    return seen


def main() -> None:
    steps = {}
    for p in points():
        for defer in (True, False):
            steps[p, defer] = bl.TrainerStep(overrides(**dict(p), defer=defer))
            print(
                f"compiled {dict(p)} defer={defer}: {steps[p, defer].compile_s:.1f} s", flush=True
            )
    samples = bl.interleaved({k: s.step for k, s in steps.items()}, WARMUP, ROUNDS)
    med = {k: bl.median(v) for k, v in samples.items()}
    base_ga = {
        (dict(p)["ga"], defer): med[p, defer]
        for (p, defer) in med
        if all(dict(p)[f] == BASE[f] for f in BASE if f != "ga")
    }
    o, c, a = bl.fit_deferral(base_ga)
    base_point = tuple(sorted(BASE.items()))
    base_params_bytes = steps[base_point, True].reduction_bytes("outside")
    rows = []
    for factor, values in FACTORS.items():
        for v in values:
            p = tuple(sorted({**BASE, factor: v}.items()))
            d, u = steps[p, True], steps[p, False]
            td, tu = med[p, True], med[p, False]
            n = dict(p)["ga"]
            # o holds the optimizer update and the one reduction, both proportional
            # to the parameters: the variant scales it by the gradient bytes.
            o_scaled = o * d.reduction_bytes("outside") / base_params_bytes
            if factor == "ga":
                cc, aa, fitted = c, a, bl.fitted_speedup(o, c, a, n)
                ceiling_o_scaled = bl.ceiling(c, a, n)
            else:
                aa = (tu - td) / (n - 1)
                cc = (td - o - aa) / n
                fitted = float("nan")
                ceiling_o_scaled = bl.ceiling((td - o_scaled - aa) / n, aa, n)
            rows.append(
                {
                    "factor": factor,
                    "value": v,
                    **dict(p),
                    "per_microbatch_s": tu,
                    "deferred_s": td,
                    "speedup": tu / td,
                    "fitted_speedup": fitted,
                    "ceiling": bl.ceiling(cc, aa, n),
                    "ceiling_o_scaled": ceiling_o_scaled,
                    "speedup_over_ceiling": (tu / td - 1) / (bl.ceiling(cc, aa, n) - 1)
                    if bl.ceiling(cc, aa, n) > 1
                    else float("nan"),
                    "c_s": cc,
                    "a_s": aa,
                    "deferred_in_loop_bytes": d.reduction_bytes("in_loop"),
                    "deferred_outside_bytes": d.reduction_bytes("outside"),
                    "per_microbatch_in_loop_bytes": u.reduction_bytes("in_loop"),
                    "per_microbatch_outside_bytes": u.reduction_bytes("outside"),
                    "deferred_memory_bytes": d.memory["total"],
                    "per_microbatch_memory_bytes": u.memory["total"],
                    "deferred_spread": (max(samples[p, True]) - min(samples[p, True])) / td,
                }
            )
    write(rows, (o, c, a))


def _misses_text(rows) -> str:
    """Which rows fall below 0.95 of their ceiling, and why, for the results page."""
    missed = [r for r in rows if r["speedup"] / r["ceiling"] < 0.95]
    if not missed:
        return "All rows meet it."

    def listed(ceiling_key):
        return ", ".join(
            f"{LABEL[r['factor']]}={r['value']}: {r['speedup'] / r[ceiling_key]:.3f}"
            for r in missed
        )

    return (
        f"Below 0.95: {listed('ceiling')}. Why: the ceiling leaves out o (the work outside "
        "the loop: optimizer update, the one reduction), which weighs most in the smallest "
        "configurations, and these rows reuse the sweep's o although they have fewer "
        "parameters. With o scaled by each row's gradient bytes the same rows give "
        f"{listed('ceiling_o_scaled')}."
    )


def write(rows, fit) -> None:
    o, c, a = fit
    lines = bl.header(
        "Deferred vs per-microbatch gradient reduction (trainer, 8 CPU devices)",
        COMMAND,
        [
            "mesh data=8, shard_mode=explicit; base: tagtrain-tiny with 6 layers "
            "(1 dense + 5 MoE), 16 experts (top-2), f32, 1 sequence x 32 tokens per device "
            "per microbatch, GA=4; one factor varied at a time",
            f"median of {ROUNDS} steady steps after {WARMUP} warm-up rounds, all "
            f"{2 * len(points())} compiled steps interleaved in each round",
            f"GA-sweep fit T = o + N*c + {{N*a | a}}: o = {o * 1e3:.1f} ms, c = {c * 1e3:.1f} ms, "
            f"a = {a * 1e3:.2f} ms",
            bl.accumulation_note(),
            "bytes: all-reduce + reduce-scatter payload per device per step (hlo_tools); "
            "memory: compiled memory analysis per device",
        ],
    )
    table_rows = []
    for r in rows:
        table_rows.append(
            [
                LABEL[r["factor"]],
                r["value"],
                f"{r['per_microbatch_s'] * 1e3:.1f}",
                f"{r['deferred_s'] * 1e3:.1f}",
                f"{r['speedup']:.3f}x",
                "" if r["fitted_speedup"] != r["fitted_speedup"] else f"{r['fitted_speedup']:.3f}x",
                f"{r['ceiling']:.3f}x",
                f"{r['speedup'] / r['ceiling']:.3f}",
                f"{bl.mib(r['per_microbatch_in_loop_bytes'])} / "
                f"{bl.mib(r['per_microbatch_outside_bytes'])}",
                f"{bl.mib(r['deferred_in_loop_bytes'])} / {bl.mib(r['deferred_outside_bytes'])}",
                f"{r['deferred_memory_bytes'] / r['per_microbatch_memory_bytes']:.3f}",
            ]
        )
    lines += bl.table(
        [
            "factor",
            "value",
            "per-microbatch ms",
            "deferred ms",
            "speedup",
            "fitted",
            "ceiling (c+a)/(c+a/N)",
            "speedup / ceiling",
            "reduce MiB/step in loop / outside: per-microbatch",
            "deferred",
            "memory deferred / per-mb",
        ],
        table_rows,
        align="lrrrrrrrrrr",
    )
    worst_in_loop = max(r["deferred_in_loop_bytes"] for r in rows)
    lines += [
        "",
        "In-loop reduction bytes with deferral: "
        + (
            "0 everywhere (gradients, loss sums, token counts and balance losses are all "
            "reduced once, after the loop)"
            if worst_in_loop == 0
            else f"NOT zero: up to {worst_in_loop} bytes per step, see the table"
        )
        + ".",
        "Target (issue 9): speedup >= 0.95 of the ceiling. Rows with GA=4 other than the "
        "GA sweep take a = (T_pm - T_def)/(N-1) and c = (T_def - o - a)/N with the sweep's o; "
        "the ceiling ignores o, the fitted column includes it. " + _misses_text(rows),
        "",
        f"Per microbatch, the gradient all-reduce runs inside the layer scan, once per layer "
        f"and microbatch, so even GA=1 differs ({rows[0]['speedup']:.2f}x measured, 1.00x by "
        "the model, which has no per-layer term). CPU collectives are in-process copies "
        f"between virtual devices on 2 shared cores; here a/c = {a / c:.2f}. Step times on "
        "this machine are noisy at the few-percent level even interleaved; the byte and "
        "memory columns are exact.",
        "",
        "![deferral](deferral.png)",
    ]
    bl.write("deferral", lines, rows)
    bl.plot_bars(
        os.path.join(bl.RESULTS, "deferral.png"),
        "per-microbatch / deferred step time (8 CPU devices)",
        [f"{LABEL[r['factor']].split('/')[0]}={r['value']}" for r in rows],
        {
            "measured": [r["speedup"] for r in rows],
            "ceiling": [r["ceiling"] for r in rows],
        },
        "speedup",
    )


if __name__ == "__main__":
    main()
