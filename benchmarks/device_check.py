"""Device check: the trainer on this host's accelerator, deferred (plain and fused) vs
per-microbatch reduction, the layers unrolled (scan_layers=auto on a GPU) and scanned,
against a plain-JAX dense reference.

deepseek3-small with per_device_batch_size=8 and GA=4 on one GPU (on CPU:
tagtrain-tiny on 8 virtual devices, so CI keeps the script working), 20 steps per
path on one fixed batch (the loss must fall on every path). Per path: median step
time after the first step, tokens/s, MFU (trainer.model.flops), peak memory
(`memory_stats()['peak_bytes_in_use']`, a high-water mark that never resets, so
every path runs in a process of its own), compiled memory per device, the
gradient-reduction bytes per step in the microbatch loop and after it, and the
share of those bytes the compiled schedule overlaps with compute
(hlo_tools.overlap_report). `--variant NAME:key=value,...` adds a path: the
deferred one with those overrides (a key the trainer lacks gives an error row).
If deepseek3-small does not fit, a 6-layer cut of it runs instead. Also, each in
a process of its own: a 2-step profile of the deferred path on a GPU (kernels per
step, kernel time by category: gpu_profile.py); the step-1 gradients of the
plain and fused schedules against each other and against an f32 run (a 6-layer
cut); the dense reference (dense_reference.py: same width, heads, sequence and
FLOPs per token), whose MFU tagtrain's is divided by.

    benchmarks/device_check.sh [--cpu] [--steps N] [--variant bf16:accum_dtype=bfloat16]

Writes device_check.md and .csv to benchmarks/results (or --out DIR) and prints
the page; with a profile, also device_check_profile.json (the profiled path's keys,
step ms, kernel ms by group: what bench_gpu_estimate.py --refit fits the GPU
estimate's calibration to). Needs only JAX, Flax, Optax and NumPy: the .sh puts packages/*/src on
PYTHONPATH, nothing is installed, nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMAND = "benchmarks/device_check.sh"
# gradient_accumulation_schedule pinned on every path: the plain deferred path, the
# fused one (each layer's gradient added into the accumulator in the backward scan)
# and the per-microbatch one, whatever the trainer's default.
PLAIN = {"gradient_accumulation_schedule": "plain"}
# The fused schedule works inside the backward layer scan, so its path scans the
# layers (scan_layers=auto unrolls them on a GPU, where fused would run as plain);
# "scanned" is the deferred path with the layers scanned, the layout fused runs in.
SCANNED = {"scan_layers": "true"}
PATHS = {
    "deferred": {"gradient_reduction_policy": "deferred", **PLAIN},
    "fused": {
        "gradient_reduction_policy": "deferred",
        "gradient_accumulation_schedule": "fused",
        **SCANNED,
    },
    "per_microbatch": {"gradient_reduction_policy": "per_microbatch", **PLAIN},
    "scanned": {"gradient_reduction_policy": "deferred", **PLAIN, **SCANNED},
}
SHAPES = {
    "accelerator": {"model_name": "deepseek3-small", "per_device_batch_size": "8"},
    "fallback": {
        "model_name": "deepseek3-small",
        "base_num_decoder_layers": "6",
        "per_device_batch_size": "2",
    },
    "cpu": {"model_name": "tagtrain-tiny", "per_device_batch_size": "1"},
}
BUDGET_S = 420  # stop starting paths after this: the whole check stays under 8 minutes
GIB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="8 virtual CPU devices, tagtrain-tiny")
    p.add_argument("--steps", type=int, default=0, help="steps per path (default 20; 3 on CPU)")
    p.add_argument("--ga", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (repeat)")
    p.add_argument(
        "--shape",
        choices=("accelerator", "fallback"),
        default="accelerator",
        help="on an accelerator: deepseek3-small (its 6-layer cut when it runs out of "
        "memory), or the cut from the start",
    )
    p.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"the built-in paths to run, comma-separated (default: {','.join(PATHS)})",
    )
    p.add_argument("--out", default="", help="results folder (default benchmarks/results)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def variant(text: str) -> tuple[str, dict[str, str]]:
    """``fused:fused_accumulation=true,accum_dtype=bfloat16`` -> (name, overrides)."""
    name, _, rest = text.partition(":")
    pairs = [kv.partition("=") for kv in rest.split(",") if kv]
    if not name or any(not sep for _, sep, _ in pairs):
        raise SystemExit(f"--variant {text!r}: expected NAME:key=value,...")
    return name, {k: v for k, _, v in pairs}


def child(spec: dict) -> dict:
    """One measurement in this process (spec["kind"]: path, grads, reference)."""
    import jax

    if spec["cpu"]:
        jax.config.update("jax_num_cpu_devices", 8)
    kind = spec.get("kind", "path")
    if kind == "grads":
        return gradient_check(spec)
    if kind == "reference":
        return reference(spec)
    return train_path(spec)


def train_path(spec: dict) -> dict:
    """One path: build, compile, step on a fixed batch; the measurements as a dict."""
    import benchlib as bl
    import jax

    import hlo_tools as ht
    from trainer.model import flops

    device = jax.devices()[0]
    out = {"device": device.device_kind, "devices": jax.device_count()}
    try:
        step = bl.TrainerStep(spec["overrides"])
        times, losses = [], []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            _, metrics = jax.block_until_ready(step.step())
            times.append(time.perf_counter() - start)
            losses.append(float(metrics["loss"]))
        # The profile reader is a GPU trace's (gpu_profile: kernel names by category),
        # and what --refit fits the GPU calibration to: a TPU's trace would give an
        # empty profile that reads as a GPU run of no kernels.
        profiled = spec.get("profile") and device.platform == "gpu"
        profile = profile_steps(step, 2) if profiled else None
    except Exception as e:  # an OOM or a key this trainer lacks: a row, not a crash
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
        return {**out, "status": "OOM" if oom else f"error: {text[:160]}"}
    config = step.config
    seconds = statistics.median(times[1:] or times)
    tokens_per_s = step.run.batch_size * config.max_target_length / seconds
    peak = flops.peak_tflops(config.output, device.device_kind)
    stats = device.memory_stats() or {}
    overlap = ht.overlap_report(step.module)["gradient_reductions"]["share"]
    return {
        **out,
        "status": "ok",
        "model": config.model_name,
        "layers": config.base_num_decoder_layers,
        "tokens_per_step": step.run.batch_size * config.max_target_length,
        "step_ms": 1e3 * seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": flops.training_flops_per_token(config.model, config.data)
        * tokens_per_s
        / (peak * 1e12 * out["devices"])
        if peak
        else None,
        "peak_gib": stats["peak_bytes_in_use"] / GIB if "peak_bytes_in_use" in stats else None,
        "compiled_gib": step.memory["total"] / GIB,
        "reduce_mib_in_loop": step.reduction_bytes("in_loop") / (1 << 20),
        "reduce_mib_after": step.reduction_bytes("outside") / (1 << 20),
        "overlapped": overlap,
        "loss": losses[0],
        "loss_last": losses[-1],
        "falls": losses[-1] < losses[0],
        "compile_s": step.compile_s,
        "profile": profile,
    }


def profile_steps(step, count: int) -> dict:
    """Kernels per step and kernel time by category over `count` profiled steps."""
    import tempfile

    import gpu_profile
    import jax

    trace = tempfile.mkdtemp(prefix="device_check_trace_")
    jax.profiler.start_trace(trace)
    for _ in range(count):
        jax.block_until_ready(step.step())
    jax.profiler.stop_trace()
    return gpu_profile.read(trace, count)


def gradient_check(spec: dict) -> dict:
    """Step-1 gradients of the plain and fused schedules, and of plain in f32.

    Relative differences of the whole gradient (norm of the difference over the
    norm): fused vs plain in the compute dtype, and each against the f32 run, so
    "agree" reads against the rounding bf16 itself brings.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    import accum
    from trainer.config import make_config
    from trainer.run import run as run_lib
    from trainer.step import train_step

    def grads(overrides, schedule):
        config = make_config({"enable_tensorboard": "false", **overrides})
        run = run_lib.setup(config, jax.devices())
        loss_fn = train_step.make_loss_fn(config.model, run.model, run.state["router"], None)

        def fn(params, batch):
            return accum.accumulate_gradients(
                loss_fn, params, batch, num_microbatches=config.gradient_accumulation_steps,
                plan=run.plan, schedule=schedule, accum_dtype=jnp.float32,
            )[2]  # fmt: skip

        with jax.set_mesh(run.ctx.mesh):
            out = jax.jit(fn)(run.state["params"], run_lib.batch_for(run, 0))
        return np.concatenate([np.ravel(np.asarray(g, np.float32)) for g in jax.tree.leaves(out)])

    # Both schedules on scanned layers: fused is only fused inside the layer scan.
    overrides = {**spec["overrides"], **SCANNED}
    try:
        plain, fused = grads(overrides, "plain"), grads(overrides, "fused")
        f32 = grads({**overrides, "dtype": "float32"}, "plain")
    except Exception as e:  # noqa: BLE001 - a row, not a crash
        return {"status": f"error: {str(e).strip().splitlines()[0][:160]}"}

    def rel(a, b):
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    return {
        "status": "ok",
        "fused_vs_plain": rel(fused, plain),
        "plain_vs_f32": rel(plain, f32),
        "fused_vs_f32": rel(fused, f32),
    }


def reference(spec: dict) -> dict:
    """The plain-JAX dense reference on this host, at the trainer shape's FLOPs per token."""
    import dense_reference
    import jax

    from trainer.config import make_config
    from trainer.model import flops

    config = make_config(spec["overrides"])
    batch = config.per_device_batch_size * config.gradient_accumulation_steps
    try:
        out = dense_reference.measure(config.model, config.data, int(batch), spec["steps"])
    except Exception as e:  # noqa: BLE001 - a row, not a crash
        return {"status": f"error: {str(e).strip().splitlines()[0][:160]}"}
    device = jax.devices()[0]
    peak = flops.peak_tflops(config.output, device.device_kind)
    mfu = out["flops_per_token"] * out["tokens_per_s"] / (peak * 1e12) if peak else None
    return {"status": "ok", "device": device.device_kind, "mfu": mfu, **out}


def run_path(spec: dict, timeout: float) -> dict:
    """`child(spec)` in a fresh process; a failed or timed-out one comes back as a status."""
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if spec["cpu"] else {}))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1].removeprefix("RESULT "))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": f"exit {proc.returncode}: {tail[:160]}"}


def accelerator() -> bool:
    """Whether JAX finds an accelerator, asked in a throwaway process (this one must
    not initialise the GPU: the paths' processes need its memory)."""
    probe = "import jax; print(jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip().splitlines()[-1:] != ["cpu"]


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def page(args, shape: dict, rows: list[dict], notes: list[str]) -> list[str]:
    import benchlib as bl

    first = next((r for r in rows if r.get("status") == "ok"), rows[0])
    where = f"{first.get('devices', '?')} x {first.get('device', '?')}"
    title = f"Device check: {shape['model_name']} GA={args.ga} on {where}"
    command = (
        COMMAND
        + (" --cpu" if args.cpu else "")
        + (f" --shape {args.shape}" if args.shape != "accelerator" else "")
        + (f" --paths {args.paths}" if args.paths != ",".join(PATHS) else "")
        + "".join(f" --variant {v}" for v in args.variant)
    )
    lines = bl.header(title, command, notes)
    columns = (
        "path",
        "overrides",
        "step ms",
        "tokens/s",
        "MFU",
        "peak GiB",
        "compiled GiB/device",
        "grad reduce MiB/step in loop",
        "after loop",
        "overlapped",
        "loss step 1",
        "loss last step",
        "falls",
        "compile s",
        "status",
    )
    body = [
        (
            r["path"],
            r["overrides"],
            fmt(r.get("step_ms")),
            fmt(r.get("tokens_per_s"), ",.0f"),
            fmt(r.get("mfu"), ".1%"),
            fmt(r.get("peak_gib"), ".2f"),
            fmt(r.get("compiled_gib"), ".3f"),
            fmt(r.get("reduce_mib_in_loop"), ".2f"),
            fmt(r.get("reduce_mib_after"), ".2f"),
            fmt(r.get("overlapped"), ".0%"),
            fmt(r.get("loss"), ".4f"),
            fmt(r.get("loss_last"), ".4f"),
            {True: "yes", False: "NO"}.get(r.get("falls"), "-"),
            fmt(r.get("compile_s")),
            r["status"],
        )
        for r in rows
    ]
    return lines + bl.table(columns, body, "ll" + "r" * 12 + "l")


def side_checks(args, shape: dict, steps: int, start: float) -> dict:
    """The gradient check (a 6-layer cut on an accelerator) and the dense reference."""
    ga = {"gradient_accumulation_steps": str(args.ga)}
    grads_shape = SHAPES["cpu"] if args.cpu else SHAPES["fallback"]
    specs = {
        "grads": {"kind": "grads", "overrides": {**grads_shape, **ga}},
        "reference": {"kind": "reference", "overrides": {**shape, **ga}, "steps": steps},
    }
    out = {}
    for name, spec in specs.items():
        left = args.budget_s - (time.monotonic() - start)
        if left <= 0:
            out[name] = {"status": "skipped: time budget spent"}
            continue
        out[name] = run_path({"cpu": args.cpu, **spec}, timeout=left + 60)
    return out


def write_profile(args, shape: dict, paths: dict, rows: list[dict], extras: dict) -> None:
    """device_check_profile.json beside the page: the profiled path's keys, step time
    and kernel ms by group, what `bench_gpu_estimate.py --refit` fits hlo_tools'
    GPU calibration to (it compiles the same keys for a compile-only GPU), and the
    dense reference's step time (that page's held-out row)."""
    import benchlib as bl

    row = next((r for r in rows if r.get("profile")), None)
    if row is None:
        return
    data = {
        "device": row.get("device"),
        "path": row["path"],
        "overrides": {**shape, **paths[row["path"]]},
        "step_ms": row.get("step_ms"),
        **row["profile"],
        "reference": {
            k: v for k, v in extras.get("reference", {}).items() if k in ("status", "step_ms")
        },
        "versions": bl.versions(),
        "tree": bl.revision(),
    }
    path = os.path.join(args.out or bl.RESULTS, "device_check_profile.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def side_lines(rows: list[dict], extras: dict) -> list[str]:
    """The page's sections after the paths' table: profile, gradients, reference."""
    lines = []
    profile = next((r["profile"] for r in rows if r.get("profile")), None)
    if profile:
        total = sum(profile["ms_per_step_by_category"].values())
        lines += [
            "",
            f"Kernels per step (2-step profile of the first path): "
            f"{profile['kernels_per_step']:,.0f}; GPU kernel time {total:.1f} ms per step:",
            "",
        ]
        by_time = sorted(profile["ms_per_step_by_category"].items(), key=lambda kv: -kv[1])
        lines += [f"- {cat}: {ms:.1f} ms ({ms / total:.1%})" for cat, ms in by_time]
    g = extras.get("grads", {})
    lines += ["", "Gradients agree (step 1, fused vs plain schedule, and each vs an f32 run):", ""]
    if g.get("status") == "ok":
        lines.append(
            f"- fused vs plain {g['fused_vs_plain']:.2e}; plain vs f32 {g['plain_vs_f32']:.2e}; "
            f"fused vs f32 {g['fused_vs_f32']:.2e} (relative norm of the difference)"
        )
        lines.append(
            "- fused vs plain is the schedules' check (same dtype, same routing). Against "
            "the f32 run the gap is mostly routing: at initialisation the router's logits "
            "are near ties, and bf16 rounding sends some tokens to other experts than f32 "
            "does, so whole expert outputs (and their gradients) differ. Not a defect of "
            "either schedule; it falls with routing forced equal (issue 53)."
        )
    else:
        lines.append(f"- {g.get('status', 'not run')}")
    ref = extras.get("reference", {})
    lines += ["", "Plain-JAX dense reference (benchmarks/dense_reference.py):", ""]
    if ref.get("status") == "ok":
        s = ref["shape"]
        first = next((r for r in rows if r.get("status") == "ok" and r.get("mfu")), None)
        ratio = (
            f"; tagtrain's MFU / reference's: {first['mfu'] / ref['mfu']:.2f}"
            if (first and ref.get("mfu"))
            else ""
        )
        lines.append(
            f"- {s['layers']} layers, width {s['d']}, {s['heads']} heads of {s['head']}, MLP "
            f"{s['mlp']}, vocab {s['vocab']}, attention {ref['attention']}: "
            f"{ref['step_ms']:.1f} ms per step, {ref['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {fmt(ref['mfu'], '.1%')}{ratio}"
        )
    else:
        lines.append(f"- {ref.get('status', 'not run')}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    args.cpu = args.cpu or not accelerator()
    steps = args.steps or (3 if args.cpu else 20)
    unknown = sorted(set(args.paths.split(",")) - set(PATHS))
    if unknown:
        raise SystemExit(f"--paths: {', '.join(unknown)} not among {', '.join(PATHS)}")
    paths = {name: PATHS[name] for name in args.paths.split(",")}
    paths.update({name: {**PATHS["deferred"], **o} for name, o in map(variant, args.variant)})
    # The results folder exists before any path runs: a lent device's minutes are not
    # spent on a page that cannot be written (an unwritable --out fails here).
    import benchlib as bl

    os.makedirs(args.out or bl.RESULTS, exist_ok=True)
    start = time.monotonic()
    shape_name = "cpu" if args.cpu else args.shape
    rows: list[dict] = []
    while True:
        shape = SHAPES[shape_name]
        rows = []
        for name, overrides in paths.items():
            left = args.budget_s - (time.monotonic() - start)
            row = {"path": name, "overrides": " ".join(f"{k}={v}" for k, v in overrides.items())}
            if left <= 0:
                rows.append({**row, "status": "skipped: time budget spent"})
                continue
            spec = {
                "cpu": args.cpu,
                "steps": steps,
                # The learning-rate schedule spans the steps run (warmup, then decay).
                "overrides": {
                    **shape,
                    "gradient_accumulation_steps": str(args.ga),
                    "steps": str(steps),
                    **overrides,
                },
                # The first path's kernels, profiled where it runs on a GPU (train_path
                # decides, from the device the path's process got).
                "profile": not rows,
            }
            # A started path may run past the budget by up to a minute: still under 8.
            rows.append({**row, **run_path(spec, timeout=left + 60)})
        if shape_name == "accelerator" and rows[0]["status"] == "OOM":
            shape_name = "fallback"  # deepseek3-small does not fit: a 6-layer cut of it
            continue
        break
    notes = [
        f"shape: {' '.join(f'{k}={v}' for k, v in shape.items())}, "
        f"gradient_accumulation_steps={args.ga}; {steps} steps per path, each in its own "
        "process; step ms: median after the first step",
        "MFU: trainer.model.flops (6 x active matmul params + attention) over the peak in "
        "trainer.model.flops.PEAK_TFLOPS (none listed for CPU); peak GiB: memory_stats() "
        "(not reported on CPU); compiled GiB: compiled.memory_analysis() per device",
        "grad reduce: all-reduce/reduce-scatter bytes per step per device (none on one device); "
        "overlapped: share of gradient-reduction bytes issued async with compute "
        "between start and done (hlo_tools)",
    ]
    if shape_name == "fallback" and args.shape != "fallback":
        notes.append("deepseek3-small ran out of memory: the fallback shape ran instead")
    elif shape_name == "fallback":
        notes.append("--shape fallback: deepseek3-small's 6-layer cut from the start")
    extras = side_checks(args, shape, steps, start)
    lines = page(args, shape, rows, notes) + side_lines(rows, extras)
    ga = {"gradient_accumulation_steps": str(args.ga)}
    write_profile(args, {**shape, **ga}, paths, rows, extras)
    # The profile is on the page; the CSV keeps one flat row per path.
    bl.write(
        "device_check",
        lines,
        [{k: v for k, v in r.items() if k != "profile"} for r in rows],
        args.out,
    )
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
