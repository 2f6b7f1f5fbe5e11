"""Multi-slice gradient reduction: TPU v5e-8 x 2 slices (16 chips) AOT, four schedules.

deepseek3-small (24 layers, 16 experts, 0.76B params), ZeRO-1, GA=4, one 1024-token
sequence per device per microbatch, remat full, compiled on this CPU host for two
v5e-8 slices joined over DCN (dcn_data=2 x data=8), in auto mode and in explicit mode
under the three reduction plans: deferred (every batch axis once per step),
per_microbatch, and hierarchical (the cross-slice axis once per step, the in-slice
'data' axis reduce-scattered per microbatch into ZeRO-1-sharded accumulators). Also
the deferred single-slice compile (v5e-8, data=8), the number aot_scale.md reports.

Per-device memory (compiled.memory_analysis()) and collective bytes per step
(trip-count weighted), split into cross-slice (the megascale DCN transfers of the
per-slice TPU program) and in-slice, in and after the loops; and accum.cost's
predicted gradient bytes beside hlo_tools' count of them (trainer.step.reduction_bytes).

Writes benchmarks/results/aot_slices.md and .csv. Needs libtpu (the `tpu` extra):

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_slices.py

Each compile's HLO and memory figures are kept under $TMPDIR/bench_aot_slices/;
`--reuse` reads them from there instead of compiling again (the analysis reruns).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

# Another process (a test run) may hold libtpu; compile-only use can share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_slices.py"
COMMON = {
    "model_name": "deepseek3-small",
    "per_device_batch_size": "1",
    "remat_policy": "full",
    "compile_topology": "v5e-8",
    "ici_data_parallelism": "8",
    "shard_optimizer_over_data": "true",
    "gradient_accumulation_steps": "4",
}
TWO_SLICES = {"compile_topology_num_slices": "2", "dcn_data_parallelism": "2"}
VARIANTS = {
    "auto": {**TWO_SLICES, "shard_mode": "auto"},
    "hierarchical": {**TWO_SLICES, "gradient_reduction_policy": "hierarchical"},
    "deferred": {**TWO_SLICES, "gradient_reduction_policy": "deferred"},
    "per_microbatch": {**TWO_SLICES, "gradient_reduction_policy": "per_microbatch"},
    "deferred, 1 slice": {"gradient_reduction_policy": "deferred"},
}


def _gradient_reductions(records):
    import hlo_tools

    return [
        c
        for c in records
        if c.kind in hlo_tools.REDUCTION_KINDS
        and c.elements > 8
        and not c.dtype.startswith(("s", "u", "pred"))
    ]


CACHE = os.path.join(tempfile.gettempdir(), "bench_aot_slices")


def compile_variant(name: str, variant: dict, reuse: bool) -> dict:
    """{"hlo", "memory_total", "hbm", "slices", "params", "data", "tree"}; cached under
    CACHE (`tree`: the checkout it was compiled from)."""
    from trainer.config import make_config
    from trainer.run import aot

    slug = name.replace(", ", "_").replace(" ", "_")
    meta_path, hlo_path = (os.path.join(CACHE, f"{slug}.{ext}") for ext in ("json", "hlo"))
    if reuse and os.path.exists(meta_path):
        with open(meta_path) as f:
            return json.load(f)
    config = make_config({**COMMON, **variant, "base_output_directory": tempfile.mkdtemp()})
    os.makedirs(CACHE, exist_ok=True)
    result = aot.compile_for_topology(config, hlo_path)
    meta = {
        "hlo": hlo_path,
        "memory_total": result.memory["total"],
        "hbm": result.hbm_bytes,
        "slices": result.num_slices,
        "params": sum(x.size for x in jax.tree.leaves(result.run.state["params"])),
        "data": dict(result.run.ctx.mesh.shape)["data"],
        "tree": bl.revision(),
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return meta


def measure(name: str, variant: dict, reuse: bool) -> dict:
    import hlo_tools

    try:
        meta = compile_variant(name, variant, reuse)
    except jax.errors.JaxRuntimeError as error:
        return {"error": str(error).strip().splitlines()[0][:200]}
    with open(meta["hlo"]) as f:
        module = hlo_tools.parse(f.read())
    records = hlo_tools.collectives(module)
    slices = meta["slices"]
    split = hlo_tools.slice_traffic(records, slices, module.num_devices)
    grads = _gradient_reductions(records)
    across, _ = hlo_tools.split_by_slice(grads, slices, module.num_devices)
    # One device's share of the f32 gradient under ZeRO-1 (1/data of it).
    shard_bytes = meta["params"] * 4 / meta["data"]
    return {
        "tree": meta.get("tree", "unknown"),
        "slices": slices,
        "memory_bytes": meta["memory_total"],
        "fits": meta["memory_total"] <= meta["hbm"],
        "cross_slice_in_loop": split["cross_slice"]["in_loop"],
        "cross_slice_outside": split["cross_slice"]["outside"],
        "in_slice_in_loop": split["in_slice"]["in_loop"],
        "in_slice_outside": split["in_slice"]["outside"],
        "cross_slice_grad_bytes": sum(c.bytes * (c.multiplier or 1) for c in across),
        "grad_shard_bytes": shard_bytes,
        "exact": split["exact"],
        **_predicted_columns(variant, module),
    }


def _predicted_columns(variant: dict, module) -> dict:
    """accum.cost's gradient operand bytes per step beside hlo_tools' count
    (docs/cost_model.md, "Which bytes are exact"), for explicit variants: across
    slices (dcn_data) and inside them ('data'), the reductions XLA moves after the
    loop placed there (accum.cost's `summed_by_the_loop`). The plan comes from an
    abstract setup of the same config (no compile)."""
    if variant.get("shard_mode") == "auto":
        return {}
    from trainer.config import make_config
    from trainer.run import aot
    from trainer.run import run as run_lib
    from trainer.step import reduction_bytes

    config = make_config({**COMMON, **variant, "base_output_directory": tempfile.mkdtemp()})
    devices = aot.devices_for(
        aot.choose_topology(config.parallelism), config.compile_topology_num_slices
    )
    run = run_lib.abstract_setup(config, devices)
    pred_in, pred_out = reduction_bytes.predicted(run)
    got_in, got_out = reduction_bytes.counted(module, dict(run.ctx.mesh.shape), ["data"])
    out = {
        "predicted_in_slice": [pred_in["data"], pred_out["data"]],
        "counted_in_slice": [got_in["data"], got_out["data"]],
    }
    if "dcn_data" in pred_in:
        out["predicted_cross_slice"] = [pred_in["dcn_data"], pred_out["dcn_data"]]
        out["counted_cross_slice"] = list(reduction_bytes.counted_cross_slice(module))
    return out


def _pair(figures) -> str:
    return " / ".join(f"{n:,}" for n in figures)


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_aot_slices: skipped, needs libtpu (uv run --extra tpu ...)")
        return 0
    reuse = "--reuse" in sys.argv[1:]
    rows = []
    for name, variant in VARIANTS.items():
        row = {"variant": name, **measure(name, variant, reuse)}
        print(row, flush=True)
        rows.append(row)
    auto = next((r for r in rows if r["variant"] == "auto" and "error" not in r), None)
    lines = bl.header(
        "Multi-slice gradient reduction: 2 x v5e-8 AOT, four schedules",
        COMMAND,
        [
            "deepseek3-small, ZeRO-1, GA=4, 1 x 1024 tokens per device per microbatch, "
            "remat full, bf16 compute, f32 weights; 2 slices: dcn_data=2 x data=8 "
            "(v5e:2x4 each, 16 chips); last row: one slice, data=8",
            "bytes per step per device, trip-count weighted; cross-slice = megascale (DCN) "
            "transfers of the per-slice TPU program, in-slice = its other collectives",
            "cross-slice grad x: cross-slice gradient reduction bytes per step over one "
            "device's f32 ZeRO-1 gradient shard (params x 4 B / 8): 1x = each gradient "
            "crosses the slices once per step",
            "compiled at "
            + ", ".join(dict.fromkeys(r.get("tree", "unknown") for r in rows))
            + (" (this pass read the cached HLO: --reuse)" if reuse else ""),
        ],
    )
    table_rows = []
    for r in rows:
        if "error" in r:
            table_rows.append([r["variant"], f"fails: {r['error']}"] + [""] * 6)
            continue
        ratio = f"{r['memory_bytes'] / auto['memory_bytes']:.2f}" if auto else ""
        table_rows.append(
            [
                r["variant"],
                f"{r['memory_bytes'] / 2**30:.2f}{'' if r['fits'] else ' (over 16 GiB)'}",
                ratio,
                bl.mib(r["cross_slice_in_loop"]),
                bl.mib(r["cross_slice_outside"]),
                f"{r['cross_slice_grad_bytes'] / r['grad_shard_bytes']:.2f}x",
                bl.mib(r["in_slice_in_loop"]),
                bl.mib(r["in_slice_outside"]),
            ]
        )
    lines += bl.table(
        [
            "schedule",
            "memory GiB/device",
            "/ auto",
            "cross-slice MiB/step in loop",
            "cross-slice after",
            "cross-slice grad x",
            "in-slice MiB/step in loop",
            "in-slice after",
        ],
        table_rows,
        align="lrrrrrrr",
    )
    lines += [
        "",
        "Gradient operand bytes per device per step, accum.cost's prediction vs hlo_tools' "
        "count (docs/cost_model.md, 'Which bytes are exact'); the prediction places the "
        "reductions XLA moves after the loop there (the leaves the loop only sums; "
        "docs/cost_model.md, 'What XLA moves') and counts a small vector whole across "
        "slices (the f32 norm scales: docs/cost_model.md, 'Across slices').",
        "",
    ]
    lines += bl.table(
        ["schedule", "axis", "predicted in loop / after", "counted in / after"],
        [
            [r["variant"], axis, _pair(r[f"predicted_{key}"]), _pair(r[f"counted_{key}"])]
            for r in rows
            if "predicted_in_slice" in r
            for axis, key in (("dcn_data", "cross_slice"), ("data", "in_slice"))
            if f"predicted_{key}" in r
        ],
    )
    lines += [
        "",
        "Targets: hierarchical memory <= 1.05x auto's; cross-slice gradient bytes per step "
        "1x the gradient (auto and per_microbatch: GA x); deferred single-slice as in "
        "aot_scale.md.",
    ]
    bl.write("aot_slices", lines, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
