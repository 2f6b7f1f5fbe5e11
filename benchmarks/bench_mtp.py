"""What multi-token prediction costs: MTP off, depth 1 and depth 2, next to its parameters.

Issue 31's cost page. Two parts, one run:

- CPU (8 virtual devices): tagtrain-test (the issue's "deepseek3-test", this CPU
  shape renamed), explicit, data parallel, GA=4, one sequence of 128 tokens per
  device per microbatch. The three steps are compiled once and timed interleaved
  (each round steps every configuration once, every other round in reverse);
  reported are the median step, the median (quartiles) of the per-round ratios to
  the MTP-off step of the same round, and the compiled memory per device.
- v5e-8 AOT compile (never run): the seed's AOT case, tagtrain-test explicit ZeRO-1
  GA=4 (test_aot.py's zero1_v5e8), memory per device from compiled.memory_analysis().

Beside each: the MTP depths' own parameters and their share of the total (the
embedding and the output head are shared, counted once), and the gradient
reductions inside the microbatch loop (0 bytes: MTP keeps one reduction per step).

Writes benchmarks/results/mtp.md and .csv:

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_mtp.py

BENCH_ROUNDS sets the CPU rounds (default 15); BENCH_SKIP_AOT=1 leaves out the
v5e-8 compiles (without libtpu they are left out and the page says so).
"""

from __future__ import annotations

import os
import statistics
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

from trainer.model import flops  # noqa: E402

WARMUP = 2
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "15"))
DEPTHS = (0, 1, 2)
CPU = {
    "model_name": "tagtrain-test",
    "shard_mode": "explicit",
    "gradient_accumulation_steps": "4",
    "per_device_batch_size": "1",
}
V5E8 = {**CPU, "compile_topology": "v5e-8", "shard_optimizer_over_data": "true"}
COMMAND = " ".join(
    [f"{key}={os.environ[key]}" for key in ("BENCH_ROUNDS", "BENCH_SKIP_AOT") if key in os.environ]
    + ["JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_mtp.py"]
)


def _params(state_params) -> tuple[int, int]:
    """(total parameter elements, the MTP depths' own)."""
    return flops.count_params(state_params), flops.mtp_param_count(state_params)


def _in_loop_reduction_bytes(module) -> int:
    import hlo_tools

    flows = hlo_tools.traffic(module)["in_loop"]
    return sum(r["bytes_per_step"] for k, r in flows.items() if k in hlo_tools.REDUCTION_KINDS)


def cpu_rows() -> list[dict]:
    """One row per depth: median step, paired ratios to depth 0, memory, parameters."""
    steps, failed = bl.compile_steps(
        {depth: {**CPU, "mtp_num_layers": str(depth)} for depth in DEPTHS}
    )
    if failed:
        raise SystemExit(f"could not build: {failed}")
    samples = bl.interleaved({d: s.step for d, s in steps.items()}, WARMUP, ROUNDS)
    rows = []
    for depth, step in steps.items():
        total, own = _params(step.run.state["params"])
        # Paired per round: the steps ran back to back, so load drift cancels.
        ratios = [a / b for a, b in zip(samples[depth], samples[0], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        rows.append(
            {
                "part": "cpu",
                "mtp_num_layers": depth,
                "step_s": bl.median(samples[depth]),
                "over_off": bl.median(ratios),
                "over_off_q1": q1,
                "over_off_q3": q3,
                "memory_bytes": step.memory["total"],
                "params": total,
                "mtp_params": own,
                "in_loop_reduction_bytes": step.reduction_bytes("in_loop"),
                "compile_s": step.compile_s,
            }
        )
    return rows


def aot_rows() -> list[dict]:
    """One row per depth: the v5e-8 compile's memory per device and parameters."""
    import hlo_tools
    from trainer.config import make_config
    from trainer.run import aot

    rows = []
    for depth in DEPTHS:
        directory = tempfile.mkdtemp(prefix="bench_mtp_")
        config = make_config(
            {**V5E8, "mtp_num_layers": str(depth), "base_output_directory": directory}
        )
        result = aot.compile_for_topology(config)
        total, own = _params(result.run.state["params"])
        module = hlo_tools.parse(result.compiled.as_text())
        rows.append(
            {
                "part": "v5e-8",
                "mtp_num_layers": depth,
                "memory_bytes": result.memory["total"],
                "hbm_bytes": result.hbm_bytes,
                "params": total,
                "mtp_params": own,
                "in_loop_reduction_bytes": _in_loop_reduction_bytes(module),
            }
        )
        print(f"compiled v5e-8 mtp_num_layers={depth}", flush=True)
    return rows


def share_671b() -> dict:
    """deepseek3-671b with one depth: parameters (abstract, nothing allocated)."""
    from trainer import model as model_lib
    from trainer.config import make_config
    from trainer.run.spec import resolve_abstract

    config = make_config({"model_name": "deepseek3-671b", "mtp_num_layers": "1"})
    spec = resolve_abstract(config)
    total, own = _params(model_lib.abstract_state(spec.model, spec.ctx)[0])
    plain = make_config({"model_name": "deepseek3-671b"})
    return {
        "part": "deepseek3-671b",
        "mtp_num_layers": 1,
        "params": total,
        "mtp_params": own,
        "flops_over_off": flops.training_flops_per_token(config.model, config.data)
        / flops.training_flops_per_token(plain.model, plain.data),
    }


def _share(row: dict) -> str:
    return f"{row['mtp_params'] / 1e6:.3f}M ({row['mtp_params'] / row['params'] * 100:.1f}%)"


def _cpu_table(rows: list[dict]) -> list[str]:
    off = rows[0]
    cells = []
    for r in rows:
        ratio = (
            "1 (reference)"
            if r["mtp_num_layers"] == 0
            else f"{r['over_off']:.3f} ({r['over_off_q1']:.3f}-{r['over_off_q3']:.3f})"
        )
        cells.append(
            [
                str(r["mtp_num_layers"]),
                f"{r['step_s'] * 1e3:.1f}",
                ratio,
                bl.mib(r["memory_bytes"]),
                f"{r['memory_bytes'] / off['memory_bytes']:.3f}",
                f"{r['params'] / 1e6:.3f}M",
                _share(r),
                bl.mib(r["in_loop_reduction_bytes"]),
            ]
        )
    return bl.table(
        [
            "mtp_num_layers",
            "step ms",
            "step / off",
            "memory MiB/device",
            "memory / off",
            "params",
            "MTP params (share)",
            "in-loop reduction MiB/step",
        ],
        cells,
    )


def _aot_table(rows: list[dict]) -> list[str]:
    off = rows[0]
    cells = [
        [
            str(r["mtp_num_layers"]),
            bl.mib(r["memory_bytes"]),
            f"{r['memory_bytes'] / off['memory_bytes']:.3f}",
            f"{r['params'] / 1e6:.3f}M",
            f"{r['params'] / off['params']:.3f}",
            _share(r),
            bl.mib(r["in_loop_reduction_bytes"]),
        ]
        for r in rows
    ]
    return bl.table(
        [
            "mtp_num_layers",
            "memory MiB/device",
            "memory / off",
            "params",
            "params / off",
            "MTP params (share)",
            "in-loop reduction MiB/step",
        ],
        cells,
    )


def main() -> None:
    cpu = cpu_rows()
    aot = []
    skip = os.environ.get("BENCH_SKIP_AOT") == "1"
    try:
        import libtpu  # noqa: F401

        has_libtpu = True
    except ImportError:
        has_libtpu = False
    if not skip and has_libtpu:
        aot = aot_rows()
    lines = bl.header(
        "Multi-token prediction: cost of depth 1 and 2 (tagtrain-test)",
        COMMAND,
        [
            "CPU: 8 virtual devices, explicit, data parallel, GA=4, one sequence x 128 "
            "tokens per device per microbatch, bf16 compute; "
            f"median of {ROUNDS} steady steps after {WARMUP} warm-up rounds, the three "
            "steps interleaved in each round; step / off: median (quartiles) of the "
            "per-round ratios to the MTP-off step of the same round",
            "v5e-8: AOT compile on this host (libtpu), explicit ZeRO-1, GA=4, one sequence "
            "per device per microbatch; memory: compiled.memory_analysis() total per device",
            "MTP params: the depths' own (eh_proj, norms, one MoE block each); the "
            "embedding and output head are the main model's, counted once",
            bl.accumulation_note(),
        ],
    )
    lines += ["## CPU (8 devices): step time and memory", ""] + _cpu_table(cpu) + [""]
    if aot:
        lines += ["## v5e-8 AOT compile: memory per device", ""] + _aot_table(aot) + [""]
    else:
        why = "BENCH_SKIP_AOT=1" if skip else "libtpu not installed (uv run --extra tpu)"
        lines += [f"v5e-8 AOT compile: not run ({why}).", ""]
    big = share_671b()
    lines += [
        f"deepseek3-671b with mtp_num_layers=1: {big['params'] / 1e9:.3f}B parameters, "
        f"of which MTP {big['mtp_params'] / 1e9:.3f}B ({big['mtp_params'] / big['params']:.2%}"
        f"); training FLOPs per token x{big['flops_over_off']:.4f} (trainer.model.flops, "
        "the MFU formula).",
        "",
        "Each depth adds one transformer block of the later (MoE) layers, its 2d -> d",
        "projection and a second pass through the shared output head (a vocab-sized",
        "matmul and its softmax) per token; tagtrain-test has 4 layers, so one depth is",
        "a large share of its compute. CPU times are from a 2-core machine shared with",
        "other work: a few percent of noise remains even interleaved; the memory,",
        "parameter and byte columns are exact.",
    ]
    bl.write("mtp", lines, cpu + aot + [big])


if __name__ == "__main__":
    main()
