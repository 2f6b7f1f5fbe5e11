"""The seed's collective placement at scale, from TPU v5e-8 compiles on this CPU host.

tagtrain-test and the seed's 24-layer / 16-expert shape (deepseek3-small, 0.76B params)
with ZeRO-1 and GA=4 (the seed's configuration), data parallel over 8 v5e chips,
compiled tagged (gradient_reduction_policy=deferred), untagged (per_microbatch) and in auto mode.
Reports the gradient reductions (all-reduce + reduce-scatter over > 8 floating
elements) inside the loops and after them, per step and per layer-microbatch (one
execution of the reductions inside the layer scan), beside the seed's figures
(v6e 2x2, its own trainer): untagged 34 MiB in-loop per layer-microbatch plus 509 MiB
outside; tagged 0.0 MiB in-loop plus 2809 MiB outside.

Writes benchmarks/results/aot_scale.md, .csv and .png. Needs libtpu (the `tpu` extra):

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_scale.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

# Another process (a test run) may hold libtpu; compile-only use can share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_aot_scale.py"
SHAPES = {
    "tagtrain-test (4L/16E)": {"model_name": "tagtrain-test", "per_device_batch_size": "2"},
    "24L/16E (deepseek3-small)": {
        "model_name": "deepseek3-small",
        "per_device_batch_size": "1",  # one 1024-token sequence per device per microbatch
        "remat_policy": "full",
    },
}
COMMON = {
    "compile_topology": "v5e-8",
    "ici_data_parallelism": "8",
    "shard_optimizer_over_data": "true",
    "gradient_accumulation_steps": "4",
}
VARIANTS = {
    "tagged (explicit, deferred)": {"shard_mode": "explicit"},
    "untagged (explicit, per microbatch)": {
        "shard_mode": "explicit",
        "gradient_reduction_policy": "per_microbatch",
    },
    "auto": {"shard_mode": "auto"},
}
SEED = {
    "tagged (explicit, deferred)": "0.0 MiB in loop (2 ops) + 2809 MiB outside",
    "untagged (explicit, per microbatch)": "34 MiB per layer-microbatch (~9 GiB/step) "
    "+ 509 MiB outside",
}


def grad_reductions(module):
    import hlo_tools

    return [
        c
        for c in hlo_tools.collectives(module)
        if c.kind in hlo_tools.REDUCTION_KINDS
        and c.cross_replica
        and c.elements > 8
        and not c.dtype.startswith(("s", "u", "pred"))
    ]


def measure(shape: dict, variant: dict) -> dict:
    import hlo_tools
    from trainer.config import make_config
    from trainer.run import aot

    config = make_config(
        {**shape, **COMMON, **variant, "base_output_directory": tempfile.mkdtemp()}
    )
    try:
        result = aot.compile_for_topology(config)
    except jax.errors.JaxRuntimeError as error:
        return {"error": str(error).strip().splitlines()[0][:200]}
    module = hlo_tools.parse(result.compiled.as_text())
    reds = grad_reductions(module)
    inside = [c for c in reds if c.in_loop]
    nested = [c for c in inside if len(c.loops) >= 2]  # inside the layer scan too
    return {
        "layers": config.base_num_decoder_layers,
        "experts": config.num_experts,
        "memory_bytes": result.memory["total"],
        "fits": result.memory["total"] <= result.hbm_bytes,
        "in_loop_ops": len(inside),
        "in_loop_bytes_per_step": sum(c.bytes_per_step or c.bytes for c in inside),
        "per_layer_microbatch_bytes": sum(c.bytes for c in nested),
        "outside_ops": len(reds) - len(inside),
        "outside_bytes": sum(c.bytes for c in reds if not c.in_loop),
        "all_collectives_bytes_per_step": hlo_tools.traffic(module)["bytes_per_step"],
    }


def main() -> int:
    if importlib.util.find_spec("libtpu") is None:
        print("bench_aot_scale: skipped, needs libtpu (uv run --extra tpu ...)")
        return 0
    rows = []
    for shape_name, shape in SHAPES.items():
        for variant_name, variant in VARIANTS.items():
            row = {"shape": shape_name, "variant": variant_name, **measure(shape, variant)}
            print(row, flush=True)
            rows.append(row)
    lines = bl.header(
        "Gradient reductions at scale: TPU v5e-8 AOT, tagged vs untagged",
        COMMAND,
        [
            "data=8 over v5e:2x4, ZeRO-1 (shard_optimizer_over_data), GA=4, bf16 compute, "
            "f32 weights; tagtrain-test: 2 x 128-token sequences per device per "
            "microbatch; 24L/16E: 1 x 1024 tokens, remat full",
            "gradient reductions: all-reduce/reduce-scatter over > 8 floating elements "
            "(the router's s32 token counts are excluded); per layer-microbatch: one "
            "execution of those inside the layer scan",
            bl.accumulation_note(),
            "seed: the reference document's v6e 2x2 measurements of its own trainer "
            "(24L/16E, pdbs 2); same model shape, different topology and batch",
        ],
    )
    table_rows = []
    for r in rows:
        if "error" in r:
            table_rows.append([r["shape"], r["variant"], f"fails: {r['error']}"] + [""] * 6)
            continue
        table_rows.append(
            [
                r["shape"],
                r["variant"],
                f"{r['in_loop_ops']}",
                bl.mib(r["in_loop_bytes_per_step"]),
                bl.mib(r["per_layer_microbatch_bytes"]),
                f"{r['outside_ops']}",
                bl.mib(r["outside_bytes"]),
                f"{bl.mib(r['memory_bytes'])}{'' if r['fits'] else ' (over 16 GiB)'}",
                SEED.get(r["variant"], "") if r["shape"].startswith("24L") else "",
            ]
        )
    lines += bl.table(
        [
            "shape",
            "variant",
            "grad reductions in loop",
            "in loop MiB/step",
            "per layer-microbatch MiB",
            "after the loop",
            "after MiB",
            "memory MiB/device",
            "seed (v6e 2x2)",
        ],
        table_rows,
        align="llrrrrrrl",
    )
    lines += [
        "",
        "Target: 0 gradient bytes in the loop on every tagged configuration.",
        "",
        "![gradient reduction bytes, 24L/16E](aot_scale.png)",
    ]
    bl.write("aot_scale", lines, rows)
    big = [r for r in rows if r["shape"].startswith("24L") and "error" not in r]
    bl.plot_bars(
        os.path.join(bl.RESULTS, "aot_scale.png"),
        "24L/16E ZeRO-1 GA=4 on v5e-8: gradient reduction bytes per step",
        [r["variant"] for r in big],
        {
            "in the loop": [r["in_loop_bytes_per_step"] / bl.MIB for r in big],
            "after the loop": [r["outside_bytes"] / bl.MIB for r in big],
        },
        "MiB per step per device",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
