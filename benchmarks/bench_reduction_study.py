"""Which gradient reduction policy, how many slices: accum.cost's predictions over a grid.

deepseek3-671b and deepseek3-small on v5p and v6e slices, 1 to 64 slices joined over
DCN (dcn_data = slices), GA 1 to 32: predicted step time per policy, the share of
it spent waiting on DCN, the accumulator per device, and where hierarchical beats
deferred (a smaller accumulator) and per_microbatch (less DCN traffic). Every
figure is a prediction of the cost model (docs/cost_model.md)
on an abstract mesh: nothing on this page is compiled or run. The byte predictions
are checked against compiles elsewhere (test_aot_matrix.py, test_aot_slices.py).

Writes benchmarks/results/reduction_study.md, .csv and .png:

    JAX_PLATFORMS=cpu uv run python benchmarks/bench_reduction_study.py
"""

from __future__ import annotations

import os
import sys

import benchlib as bl

COMMAND = "JAX_PLATFORMS=cpu uv run python benchmarks/bench_reduction_study.py"
SLICES = (1, 2, 4, 8, 16, 32, 64)
GAS = (1, 2, 4, 8, 16, 32)
# One slice's layout per (model, chip): 671b as test_aot.py's v5p-1024 compile (experts
# over 64-way expert parallelism, the rest FSDP, bf16 weights); deepseek3-small as
# aot_slices.md's recipe (data=8, ZeRO-1), on an 8-chip slice.
LAYOUT_671B = bl.trainer_test_module("layouts").DEEPSEEK3_671B_LAYOUT
LAYOUT_SMALL = dict(
    model_name="deepseek3-small", ici_data_parallelism="8", shard_optimizer_over_data="true"
)
CASES = {
    ("deepseek3-671b", "v5p"): {**LAYOUT_671B, "compile_topology": "v5p-1024"},
    ("deepseek3-671b", "v6e"): {**LAYOUT_671B, "compile_topology": "v6e-256"},
    ("deepseek3-small", "v5p"): {**LAYOUT_SMALL, "compile_topology": "v5p-16"},
    ("deepseek3-small", "v6e"): {**LAYOUT_SMALL, "compile_topology": "v6e-8"},
}
COMMON = {"per_device_batch_size": "1", "remat_policy": "full"}


def predict_grid() -> list[dict]:
    """One row per (model, chip, slices, GA, policy)."""
    import dataclasses

    from trainer.run import plan_reduction
    from trainer.step import reduction_choice

    rows = []
    for (model, chip), layout in CASES.items():
        for slices in SLICES:
            config = plan_reduction.config_of(
                [f"{k}={v}" for k, v in {**COMMON, **layout}.items()]
                + [f"compile_topology_num_slices={slices}", f"dcn_data_parallelism={slices}"]
            )
            ctx, params, grad_dtypes = plan_reduction.abstract_params(config)
            plans = reduction_choice.plans(config.parallelism, config.accumulation, ctx, params)
            for ga in GAS:
                at_ga = dataclasses.replace(config, gradient_accumulation_steps=ga)
                hw, _ = reduction_choice.hardware_for(at_ga.parallelism, at_ga.accumulation, [])
                costs = reduction_choice.predict_all(
                    at_ga.model,
                    at_ga.parallelism,
                    at_ga.accumulation,
                    at_ga.data,
                    plans,
                    params,
                    hw,
                    grad_dtypes,
                )
                chosen = reduction_choice.auto_order(costs, plans, ga)[0]
                for policy, c in costs.items():
                    rows.append(
                        {
                            "model": model,
                            "chip": chip,
                            "topology": config.compile_topology,
                            "slices": slices,
                            "ga": ga,
                            "policy": policy,
                            "auto": policy == chosen,
                            "step_s": c.step_seconds,
                            "compute_s": c.compute_seconds,
                            "exposed_s": c.exposed_seconds,
                            "dcn_share": c.dcn_share,
                            "ici_wire_bytes": c.link_bytes["ICI"],
                            "dcn_wire_bytes": c.link_bytes["DCN"],
                            "accumulator_bytes": c.accumulator_bytes,
                        }
                    )
            print(f"{model} {chip} x{slices}: done", flush=True)
    return rows


def _cell(by_policy: dict, policy: str) -> str:
    r = by_policy.get(policy)
    if r is None:
        return "-"
    mark = " **auto**" if r["auto"] else ""
    return f"{r['step_s'] * 1e3:,.0f} ms ({r['dcn_share'] * 100:.0f}% DCN){mark}"


def _marks(by_policy: dict) -> str:
    """Where hierarchical beats deferred on memory and per_microbatch on DCN traffic."""
    h, d, p = (by_policy.get(k) for k in ("hierarchical", "deferred", "per_microbatch"))
    if h is None:
        return "one slice: no hierarchical"
    out = []
    if h["accumulator_bytes"] < d["accumulator_bytes"]:
        out.append(f"mem {h['accumulator_bytes'] / d['accumulator_bytes']:.2f}x deferred")
    if h["dcn_wire_bytes"] < p["dcn_wire_bytes"]:
        out.append(f"DCN {h['dcn_wire_bytes'] / p['dcn_wire_bytes']:.2f}x per_mb")
    if h["step_s"] < min(d["step_s"], p["step_s"]):
        out.append("fastest")
    return ", ".join(out) or "-"


def page(rows: list[dict]) -> list[str]:
    lines = bl.header(
        "Reduction policy study: predicted step time per policy, 1 to 64 slices (no compiles)",
        COMMAND,
        [
            "every figure here is predicted by accum.cost (docs/cost_model.md, 'Time "
            "model') on an abstract mesh: nothing on this page was compiled or run",
            "layouts per slice: deepseek3-671b: expert=64 x fsdp (v5p-1024: 512 chips; "
            "v6e-256), bf16 weights, capacity 1.25; deepseek3-small: data=8 with ZeRO-1 "
            "(v5p-16, v6e-8); dcn_data = slices; 1 x max_target_length tokens per device "
            "per microbatch, remat full",
            "step = FLOPs / peak (100% MFU) + exposed gradient-reduction time: ring "
            "collectives at the table's per-chip ICI and DCN bandwidth, in-loop reductions "
            "exposed (XLA:TPU keeps them synchronous: aot_async.md); the other collectives "
            "(FSDP gathers, all-to-alls) are the same under every policy and left out",
            "memory: the gradient accumulator per device only (the rest of the step's "
            "memory needs a compile: `plan-reduction ... --compile`); whether 671b fits "
            "v6e's 32 GiB is not predicted here",
            "compiled elsewhere: deepseek3-small on 2 x v5e-8 under every policy "
            "(aot_slices.md), deepseek3-671b on one v5p-1024 slice (test_aot.py)",
            "**auto**: what gradient_reduction_policy=auto takes (before its compiled-memory "
            "check); hierarchical vs: accumulator against deferred's, DCN wire bytes against "
            "per_microbatch's, and 'fastest' where it is predicted fastest",
        ],
    )
    for model, chip in CASES:
        lines += [f"## {model} on {chip}", ""]
        table_rows = []
        for slices in SLICES:
            for ga in GAS:
                sel = [
                    r
                    for r in rows
                    if (r["model"], r["chip"], r["slices"], r["ga"]) == (model, chip, slices, ga)
                ]
                by_policy = {r["policy"]: r for r in sel}
                table_rows.append(
                    [
                        str(slices),
                        str(ga),
                        _cell(by_policy, "deferred"),
                        _cell(by_policy, "hierarchical"),
                        _cell(by_policy, "per_microbatch"),
                        _marks(by_policy),
                    ]
                )
        lines += bl.table(
            ["slices", "GA", "deferred", "hierarchical", "per_microbatch", "hierarchical vs"],
            table_rows,
            align="rrrrrl",
        )
        lines.append("")
    lines.append("![predicted step time and DCN share](reduction_study.png)")
    return lines


def plot(rows: list[dict], path: str) -> None:
    """Per (model, chip): predicted step time vs slices at GA=8, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(CASES), figsize=(4 * len(CASES), 6.5), sharex=True)
    for col, (model, chip) in enumerate(CASES):
        for policy in ("deferred", "hierarchical", "per_microbatch"):
            sel = [
                r
                for r in rows
                if (r["model"], r["chip"], r["ga"], r["policy"]) == (model, chip, 8, policy)
            ]
            xs = [r["slices"] for r in sel]
            axes[0, col].plot(xs, [r["step_s"] for r in sel], marker="o", label=policy)
            axes[1, col].plot(xs, [100 * r["dcn_share"] for r in sel], marker="o", label=policy)
        axes[0, col].set_title(f"{model}, {chip}, GA=8", fontsize=9)
        axes[1, col].set_xscale("log", base=2)
        axes[1, col].set_xlabel("slices")
    axes[0, 0].set_ylabel("predicted step (s)")
    axes[1, 0].set_ylabel("DCN share of step (%)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("accum.cost predictions (nothing compiled)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    rows = predict_grid()
    plot(rows, os.path.join(bl.RESULTS, "reduction_study.png"))
    bl.write("reduction_study", page(rows), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
