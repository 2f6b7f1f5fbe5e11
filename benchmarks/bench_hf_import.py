"""Importing a Hugging Face checkpoint onto 8 CPU devices: seconds and peak host RSS.

Generates (once, in BENCH_HF_DIR or a temporary directory) a DeepSeek-V3-shaped
HF directory of random bf16 weights, over 1 GB in several safetensors shards with
an index, then imports it with `trainer.hf.import_params` in a fresh process per
mesh layout (so each peak RSS is that import's alone) and reports, against the
checkpoint's size: wall seconds to the last array ready, the process's RSS before
the import (JAX and the model definition), its peak (ru_maxrss) and the bytes the
devices hold afterwards (CPU devices live in host memory, so those are in RSS).

Writes benchmarks/results/hf_import.md and .csv:

    JAX_PLATFORMS=cpu uv run python benchmarks/bench_hf_import.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import benchlib as bl

COMMAND = "JAX_PLATFORMS=cpu uv run python benchmarks/bench_hf_import.py"
# DeepSeek-V3's structure (YaRN, q_lora, 1 dense + 9 MoE layers, 32 experts) at
# about 0.57B parameters: 1.13 GB in bf16.
MODEL = {
    "vocab_size": 32_768,
    "base_emb_dim": 1024,
    "base_num_decoder_layers": 10,
    "first_num_dense_layers": 1,
    "base_mlp_dim": 2816,
    "base_moe_mlp_dim": 512,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "n_routing_groups": 4,
    "topk_routing_group": 2,
    "base_num_query_heads": 8,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "rope_type": "yarn",
    "rope_interleave": "true",
    "weight_dtype": "bfloat16",
}
SHARD_BYTES = 256 * 1024**2
LAYOUTS = {
    "fsdp=8": {"ici_fsdp_parallelism": "8", "ici_data_parallelism": "1"},
    "expert=8": {"ici_expert_parallelism": "8", "ici_data_parallelism": "1"},
    "fsdp=2 x expert=4": {
        "ici_fsdp_parallelism": "2",
        "ici_expert_parallelism": "4",
        "ici_data_parallelism": "1",
    },
}


def _config(layout: dict):
    from trainer.config import make_config

    return make_config({**MODEL, **layout})


def generate(directory: str) -> int:
    """Write the random checkpoint (unless already there); returns its bytes."""
    import numpy as np

    from trainer import hf
    from trainer import model as model_lib
    from trainer.config import hf_map
    from trainer.hf import keys, safetensors, stream

    if os.path.isfile(os.path.join(directory, safetensors.INDEX)):
        return stream.directory_size(directory)
    config = _config({})
    ctx = hf.default_ctx(config)
    params, router = model_lib.abstract_state(model_lib.define(config.model, ctx), ctx)
    trees = {"params": params, "router": router}
    leaves = keys.leaves(trees, config, "deepseek_v3")
    rng = np.random.default_rng(0)
    entries = []
    for leaf in leaves:
        dtype = safetensors.DTYPES["F32" if leaf.tree == "router" else "BF16"]
        for _, name in leaf.names():

            def produce(shape=leaf.hf_shape, dtype=dtype):
                return (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

            entries.append((name, produce, leaf.hf_shape, dtype))
    sizes = {name: int(np.prod(shape)) * dtype.itemsize for name, _, shape, dtype in entries}
    groups = safetensors.plan_shards(sizes, SHARD_BYTES)
    files = safetensors.shard_names(len(groups))
    os.makedirs(directory, exist_ok=True)
    by_name = {e[0]: e for e in entries}
    for file, group in zip(files, groups, strict=True):
        safetensors.write_file(os.path.join(directory, file), [by_name[n] for n in group])
    weight_map = {n: f for f, g in zip(files, groups, strict=True) for n in g}
    safetensors.write_index(directory, weight_map, sum(sizes.values()))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_map.to_hf(config), f, indent=2)
    return stream.directory_size(directory)


def child(directory: str, layout_name: str) -> None:
    """One import in this (fresh) process; prints a JSON line of its figures."""
    import resource
    import time

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from trainer import hf
    from trainer import model as model_lib
    from trainer.config import mesh_shape
    from trainer.sharding import ShardCtx, logical_rules, make_mesh

    config = _config(LAYOUTS[layout_name])
    mesh = make_mesh(mesh_shape(config, 8), config.shard_mode, jax.devices()[:8])
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)
    model = model_lib.define(config.model, ctx)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    start = time.perf_counter()
    trees = hf.import_params(directory, config, ctx, progress=False, model=model)
    jax.block_until_ready(trees)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(s.data.nbytes for x in jax.tree.leaves(trees) for s in x.addressable_shards)
    print(json.dumps({"seconds": seconds, "rss_before": before, "peak_rss": peak, "held": held}))


def main() -> None:
    directory = os.environ.get("BENCH_HF_DIR") or os.path.join(
        tempfile.gettempdir(), "tagtrain_bench_hf_import"
    )
    size = generate(directory)
    files = len([n for n in os.listdir(directory) if n.endswith(".safetensors")])
    rows = []
    for name in LAYOUTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", directory, name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        figures = json.loads(out.strip().splitlines()[-1])
        rows.append({"layout": name, "checkpoint_bytes": size, **figures})
    gb = 1e9
    table = bl.table(
        [
            "layout (8 CPU devices)",
            "checkpoint GB",
            "seconds",
            "GB/s",
            "RSS before GB",
            "peak RSS GB",
            "peak - before GB",
            "devices hold GB",
            "(peak - before) / devices hold",
        ],
        [
            [
                r["layout"],
                f"{size / gb:.2f}",
                f"{r['seconds']:.1f}",
                f"{size / gb / r['seconds']:.2f}",
                f"{r['rss_before'] / gb:.2f}",
                f"{r['peak_rss'] / gb:.2f}",
                f"{(r['peak_rss'] - r['rss_before']) / gb:.2f}",
                f"{r['held'] / gb:.2f}",
                f"{(r['peak_rss'] - r['rss_before']) / r['held']:.2f}",
            ]
            for r in rows
        ],
    )
    lines = bl.header(
        "Hugging Face import onto 8 CPU devices: time and peak host memory",
        COMMAND,
        [
            f"checkpoint: DeepSeek-V3 structure, random bf16 weights, {size / gb:.2f} GB in "
            f"{files} safetensors files with an index (benchmarks/bench_hf_import.py MODEL)",
            "each layout imported in a fresh process; weight_dtype=bfloat16, so the devices "
            "hold one copy of every weight per replica",
        ],
    )
    lines += table
    lines += [
        "",
        "CPU devices keep their buffers in host memory, so what the devices hold after the "
        "import is part of the peak. The import adds no host copy of the model beside "
        "them when peak - before stays near what the devices hold: each device's slice is "
        "read straight from the memory-mapped files (trainer/hf/stream.py).",
    ]
    bl.write("hf_import", lines, rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
