"""Pipeline stages against none, 8 CPU devices: step time, compiled memory, collectives.

Issue 57's CPU check: the step time of stage=2 and stage=4 (GPipe) and of stage=2
with circular stages (num_pipeline_repeats=2) against stage=1 (data=8), all with
the same model, batch and 4 microbatches (the accumulation's; the pipeline's). Each
row's bubble is the schedule's formula, (p-1)/(m x repeats + p-1). All compiled
steps are timed in one run, interleaved (each round steps every configuration
once); reported are the median step and the median of the per-round ratios to the
stage=1 step. Also per device: compiled memory, and collective bytes per step
inside the loops and after them (hlo_tools, trip-count weighted).

CPU collectives are synchronous copies and the 8 "devices" share the host's cores,
so a stage does not run beside the others here as it would on chips: the step
time shows the pipeline's overhead (the bubble's wasted iterations, the permutes,
the layers outside the pipeline run on every stage), not its speedup.

Writes benchmarks/results/pipeline_cpu.md and .csv:

    JAX_PLATFORMS=cpu uv run python benchmarks/bench_pipeline_cpu.py
"""

from __future__ import annotations

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

from trainer.config.pipeline import bubble_fraction  # noqa: E402

WARMUP = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "10"))
# The page's command line: the environment that chose its rounds included.
COMMAND = (
    "BENCH_ROUNDS=" + os.environ["BENCH_ROUNDS"] + " " if "BENCH_ROUNDS" in os.environ else ""
) + ("JAX_PLATFORMS=cpu uv run python benchmarks/bench_pipeline_cpu.py")
MICROBATCHES = 4
# tagtrain-tiny with 1 dense + 4 MoE layers (they split over 2 and 4 stages, and into
# 2 x 2 circular chunks), f32, one sequence x 32 tokens per device per microbatch.
MODEL = {
    "model_name": "tagtrain-tiny",
    "dtype": "float32",
    "base_num_decoder_layers": "5",
    "gradient_accumulation_steps": str(MICROBATCHES),
    "per_device_batch_size": "1",
    "steps": "1",
}
# label -> (stages, data, repeats)
ROWS = {
    "stage=1 x data=8": (1, 8, 1),
    "stage=2 x data=4": (2, 4, 1),
    "stage=4 x data=2": (4, 2, 1),
    "stage=2 x data=4, circular (2 repeats)": (2, 4, 2),
}
BASE = "stage=1 x data=8"


def overrides(stages: int, data: int, repeats: int) -> dict[str, str]:
    return {
        **MODEL,
        "ici_pipeline_parallelism": str(stages),
        "ici_data_parallelism": str(data),
        "num_pipeline_repeats": str(repeats),
    }


def main() -> None:
    steps, failed = bl.compile_steps({label: overrides(*row) for label, row in ROWS.items()})
    samples = bl.interleaved({k: s.step for k, s in steps.items()}, WARMUP, ROUNDS)
    rows = []
    for label, (stages, _, repeats) in ROWS.items():
        row = {"configuration": label, "stages": stages, "repeats": repeats}
        row["bubble"] = bubble_fraction(stages, MICROBATCHES, repeats)
        step = steps.get(label)
        if step is None:
            row["error"] = failed[label][:300]
            rows.append(row)
            continue
        row["step_s"] = bl.median(samples[label])
        if BASE in samples:
            ratios = [a / b for a, b in zip(samples[label], samples[BASE], strict=True)]
            row["over_stage1"] = bl.median(ratios)
        row["memory_bytes"] = step.memory["total"]
        row["in_loop_bytes"] = step.bytes("in_loop")
        row["outside_bytes"] = step.bytes("outside")
        row["reduction_in_loop_bytes"] = step.reduction_bytes("in_loop")
        rows.append(row)
    write(rows)


def _cells(row: dict) -> list[str]:
    if "step_s" not in row:
        return [row["configuration"], f"{row['bubble']:.1%}", "fails: " + row["error"][:150]]
    return [
        row["configuration"],
        f"{row['bubble']:.1%}",
        f"{row['step_s'] * 1e3:.1f}",
        f"{row.get('over_stage1', float('nan')):.3f}",
        bl.mib(row["memory_bytes"]),
        bl.mib(row["in_loop_bytes"]),
        bl.mib(row["reduction_in_loop_bytes"]),
        bl.mib(row["outside_bytes"]),
    ]


def write(rows: list[dict]) -> None:
    lines = bl.header(
        "Pipeline stages vs none (trainer, 8 CPU devices)",
        COMMAND,
        [
            "model: tagtrain-tiny with 5 layers (1 dense + 4 MoE), f32, explicit mode; "
            f"{MICROBATCHES} microbatches (gradient_accumulation_steps, the pipeline's); "
            "one sequence x 32 tokens per device per microbatch",
            f"median of {ROUNDS} steady steps after {WARMUP} warm-up rounds, all compiled "
            "steps interleaved in each round; ratio: median of the per-round ratios to "
            "the stage=1 step",
            "collectives: bytes per device per step (hlo_tools, trip-count weighted) "
            "inside loops (the pipeline's permutes) and after them; 'reductions in "
            "loops': all-reduce and reduce-scatter bytes inside loops (0: the gradients "
            "are reduced once, after the pipeline loop)",
            "CPU devices share the host's cores and run collectives as copies: this "
            "shows the pipeline's overhead, not the speedup stages running side by side "
            "would give",
        ],
    )
    lines += bl.table(
        [
            "configuration",
            "bubble",
            "step (ms)",
            "/ stage=1",
            "memory (MiB)",
            "in loops (MiB)",
            "reductions in loops (MiB)",
            "after loops (MiB)",
        ],
        [_cells(r) for r in rows],
    )
    bl.write("pipeline_cpu", lines, rows)


if __name__ == "__main__":
    main()
