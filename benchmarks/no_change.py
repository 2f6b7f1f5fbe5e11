"""Proof of no change for a refactor: the same compiled steps and the same numbers.

    python benchmarks/no_change.py record TREE OUT.json   # TREE: a checkout with its .venv
    python benchmarks/no_change.py compare BEFORE.json AFTER.json

`record` runs `uv run train` in TREE on ten configurations (CONFIGS: the README job
and the parallelism, schedule, policy, MTP and LoRA variants), 3 steps each, and writes
the sha256 of every optimized HLO module XLA dumps (metadata off, so source paths do
not count), the printed step lines without timings, and every metrics.jsonl value as a
hex float (the perf/ timings aside). `compare` says which configurations differ, and
exits 1 if any does; `record TREE OUT.json NAME...` records only the configurations
named (DATA_CONFIGS: each data source with its eval set). Used for the trainer's
restructure (issue 42: trainer CHANGELOG) and its one data-source shape (issue 56).
"""

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

BASE = (
    "model_name=tagtrain-tiny steps=3 per_device_batch_size=1 gradient_accumulation_steps=4 "
    "enable_checkpointing=false"
)
CONFIGS = {
    "main": "",
    "auto": "shard_mode=auto",
    "fsdp2": "ici_fsdp_parallelism=2",
    "expert2": "ici_expert_parallelism=2",
    "zero1": "shard_optimizer_over_data=true",
    "mtp1": "mtp_num_layers=1",
    "plain": "gradient_accumulation_schedule=plain",
    "per_mb": "gradient_reduction_policy=per_microbatch",
    "lora": "lora_rank=4",
    "overlapped_zero1": "gradient_accumulation_schedule=overlapped shard_optimizer_over_data=true",
}
# The data sources, each with its eval set (issue 56's one data-source shape): recorded
# by name (`record TREE OUT.json text_eval ...`), not in the default ten.
DATA_CONFIGS = {
    "synthetic_eval": "eval_interval=2 eval_steps=2",
    "text_eval": "dataset_type=text dataset_path=examples/text/train.txt "
    "eval_dataset_path=examples/text/held_out.txt vocab_size=512 eval_interval=2",
    "hf_eval": "dataset_type=hf hf_train_files=examples/parquet/train.parquet "
    "hf_eval_files=examples/parquet/held_out.parquet vocab_size=512 eval_interval=2",
    "sft_eval": "hf_model_path=packages/trainer/tests/fixtures/hf/v3_chat dataset_type=hf "
    "use_sft=true hf_train_files=examples/chat/train.jsonl "
    "hf_eval_files=examples/chat/held_out.jsonl max_target_length=64 eval_interval=2",
}
# Printed lines kept (timings cut): the steps, the evaluations, and the startup lines
# naming the data and the eval set.
PRINTED = ("step ", "eval ", "data:", "eval:")


def floats_hex(obj):
    """`obj` with every float as its hex string, the timings (perf/...) left out."""
    if isinstance(obj, float):
        return obj.hex()
    if isinstance(obj, dict):
        return {k: floats_hex(v) for k, v in sorted(obj.items()) if not k.startswith("perf/")}
    if isinstance(obj, list):
        return [floats_hex(v) for v in obj]
    return obj


def run(tree: str, name: str, extra: str) -> dict:
    """One configuration's record (or its error) from a 3-step `train` in `tree`."""
    out = tempfile.mkdtemp(prefix=f"proof_{name}_")
    dump = os.path.join(out, "dump")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_disable_metadata=true",
    )
    cmd = f"uv run train {BASE} {extra} base_output_directory={out} run_name=r"
    p = subprocess.run(cmd, shell=True, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr[-2000:]}
    printed = [
        re.sub(r"\s+[\d,]+ tokens/s.*", "", line)
        for line in p.stdout.splitlines()
        if line.startswith(PRINTED)
    ]
    hashes = {}
    for f in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        mod = re.sub(r"^module_\d+\.", "", os.path.basename(f))
        with open(f) as dumped:
            text = dumped.read()
        hashes.setdefault(mod, []).append(hashlib.sha256(text.encode()).hexdigest()[:16])
    with open(os.path.join(out, "r", "metrics.jsonl")) as records:
        metrics = [floats_hex(json.loads(line)) for line in records]
    return {"printed": printed, "hlo": hashes, "metrics": metrics}


def record(tree, dest, names):
    result = {}
    for n in names:
        result[n] = run(tree, n, {**CONFIGS, **DATA_CONFIGS}[n])
        print(
            n, "error" if "error" in result[n] else f"{len(result[n]['hlo'])} modules", flush=True
        )
    with open(dest, "w") as f:
        json.dump(result, f, indent=1)


def compare(before_path, after_path):
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    differ = []
    for name in before:
        same = {
            part: before[name].get(part) == after.get(name, {}).get(part)
            for part in ("hlo", "printed", "metrics")
        }
        print(name, " ".join(f"{part} {'same' if ok else 'DIFFERS'}" for part, ok in same.items()))
        if not all(same.values()) or "error" in before[name]:
            differ.append(name)
    print("identical" if not differ else f"differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record(sys.argv[2], sys.argv[3], sys.argv[4:] or list(CONFIGS))
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
