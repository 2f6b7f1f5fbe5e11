"""A GPU step's time predicted on a CPU host: compiled for one H200, never run.

Each row compiles the real train step for a compile-only H200 (`train
compile_topology=h200-1`, trainer/run/aot.py) and prices every kernel XLA would
launch on hlo_tools.gpu_estimate's roofline (trainer/run/gpu_estimate.py: the
chip's figures, the model's XLA attention priced as cuDNN's). Rows:

- calibration: the measured device run's program (compiled at a tree whose program
  is the device's: kept with `--keep` and reused, since later trees change it), its
  prediction against the measured step and the profile's per-group ms: the 2026-12-04 run
  (deepseek3-small, per_device_batch_size=8, GA=4, scan_layers=true;
  device_check.md), or the path device_check_profile.json names once a lent GPU
  has written one (benchmarks/device_check.py); also, held out, the same
  program priced with XLA's attention against the measured attention=dot_product
  path (a compile-only GPU compiles XLA's attention, so that is the device's program).
- default: deepseek3-small with today's defaults (layers unrolled on GPUs).
- h200: deepseek3-h200 with the preset's batch (per_device_batch_size=16, GA=1);
  h200-ga2: the same 16 sequences a step as 8 x GA 2, the preset's shape before
  (estimated whether they fit in HBM or not: the compiled GiB column says).
- reference: held out, the plain-JAX dense transformer device_check.py times in the
  same run as the calibration's (benchmarks/dense_reference.py: the calibration
  shape's width, sequence and FLOPs per token, no MoE, no microbatch loop, causal
  attention without a mask), compiled for the same GPU here and priced with the same
  calibration, against its measured step; a program the fit never saw.

    JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu python benchmarks/bench_gpu_estimate.py \
        [--only default] [--layers 4] [--set key=value] [--keep DIR] [--refit]

`--only NAME` (repeatable) compiles only those rows; `--layers N` cuts the models to
N decoder layers (fast iteration: the figures then describe the cut model);
`--set key=value` adds a trainer key to every row; `--cudnn` compiles cuDNN's attention
(where the nvidia-cudnn wheel is installed: `uv pip install nvidia-cudnn-cu12`; it is
not in the gpu extra) by lifting the trainer's compile-only-topology blocker in this
process, so the program is the one a device runs; `--keep DIR` keeps each row's
compiled files there and reuses them when present (`--reuse`); `--refit` fits the
calibration to the measured profile on the calibration row and prints the new table.
With --only, --layers or --set the page goes to /tmp/gpu_estimate (or --out DIR),
not over benchmarks/results/gpu_estimate.md.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import benchlib as bl  # noqa: E402
import dense_reference  # noqa: E402

import hlo_tools  # noqa: E402
from hlo_tools import gpu_estimate as ge  # noqa: E402
from trainer.config import make_config  # noqa: E402
from trainer.model import attention_kernel, cudnn_attention  # noqa: E402
from trainer.run import aot, gpu_topology  # noqa: E402
from trainer.run import gpu_estimate as tg  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu python benchmarks/bench_gpu_estimate.py"
SMALL = {"model_name": "deepseek3-small", "per_device_batch_size": "8"}
ROWS = {
    "calibration": (
        "deepseek3-small pdbs 8 GA 4, scan_layers=true (the 2026-12-04 device run's program)",
        {**SMALL, "gradient_accumulation_steps": "4", "scan_layers": "true"},
    ),
    "default": (
        "deepseek3-small pdbs 8 GA 4, defaults (layers unrolled)",
        {**SMALL, "gradient_accumulation_steps": "4"},
    ),
    # The policy pinned: auto stops with a config error when no policy fits in HBM,
    # and the estimate is wanted either way (the memory column says whether it fits).
    "h200": (
        "deepseek3-h200 pdbs 16 GA 1, defaults (the preset's batch)",
        {"model_name": "deepseek3-h200", "gradient_reduction_policy": "deferred"},
    ),
    "h200-ga2": (
        "deepseek3-h200 pdbs 8 GA 2 (the same 16 sequences in two microbatches)",
        {
            "model_name": "deepseek3-h200",
            "per_device_batch_size": "8",
            "gradient_accumulation_steps": "2",
            "gradient_reduction_policy": "deferred",
        },
    ),
    "reference": (
        "plain-JAX dense reference, the calibration run's 32 sequences in one step (held out)",
        {**SMALL, "gradient_accumulation_steps": "4"},
    ),
}
# The reference's attention, priced as cuDNN's (a compile-only GPU builds XLA's).
REFERENCE_ATTENTION = (dense_reference.causal_attention.__qualname__,)
PROFILE_JSON = os.path.join(bl.RESULTS, "device_check_profile.json")
PROFILE_PAGE = os.path.join(bl.RESULTS, "device_check.md")
PROFILE_CSV = os.path.join(bl.RESULTS, "device_check.csv")
TOP = 10
TARGET_CAPABILITY = (9, 0)  # the H200 the rows compile for (sm_90)


def measured() -> dict:
    """The measured run the calibration row is checked against: {step_ms,
    kernel_ms, kernels, groups: {profile group: ms}, xla_attention_ms, source}.
    From device_check_profile.json when a device wrote one, else device_check's page."""
    if os.path.exists(PROFILE_JSON):
        with open(PROFILE_JSON) as f:
            data = json.load(f)
        groups = data["ms_per_step_by_category"]
        return {
            "overrides": {k: v for k, v in data["overrides"].items() if k != "steps"},
            "step_ms": data.get("step_ms"),
            "kernel_ms": sum(groups.values()),
            "kernels": data.get("kernels_per_step"),
            "groups": groups,
            "xla_attention_ms": None,
            "reference_ms": data.get("reference", {}).get("step_ms"),
            "source": os.path.relpath(PROFILE_JSON, bl.RESULTS),
        }
    with open(PROFILE_PAGE) as f:
        page = f.read()
    section = page.split("GPU kernel time", 1)[1]
    groups = {}
    for line in section.splitlines()[1:]:
        m = re.match(r"^- (.+?): ([\d.]+) ms \(", line)
        if m:
            groups[m.group(1)] = float(m.group(2))
        elif groups and line.strip():
            break
    kernels = re.search(r"Kernels per step \(.*?\): ([\d,]+)", page)
    reference = re.search(r"dense reference .*?: ([\d.]+) ms per step", page, re.DOTALL)
    with open(PROFILE_CSV) as f:
        step = {r["path"]: float(r["step_ms"]) for r in csv.DictReader(f) if r["step_ms"]}
    return {
        "step_ms": step.get("deferred"),
        "kernel_ms": sum(groups.values()),
        "kernels": int(kernels.group(1).replace(",", "")) if kernels else None,
        "groups": groups,
        "xla_attention_ms": step.get("dot_product"),
        "reference_ms": float(reference.group(1)) if reference else None,
        "source": "device_check.md (2026-12-04, one H200)",
        "overrides": ROWS["calibration"][1],
    }


def allow_cudnn_deviceless() -> None:
    """Let `attention=auto` pick cuDNN on a compile-only GPU (--cudnn): the trainer
    blocks it there because without the cuDNN library jax cannot build the call; with
    the nvidia-cudnn wheel, XLA compiles cuDNN's flash attention without a device."""
    if importlib.util.find_spec("nvidia.cudnn") is None:
        raise SystemExit("--cudnn needs the nvidia-cudnn wheel: uv pip install nvidia-cudnn-cu12")
    blockers = attention_kernel.cudnn_flash_blockers

    def without_compile_only(config, ctx):
        return [b for b in blockers(config, ctx) if "compile-only" not in b]

    attention_kernel.cudnn_flash_blockers = without_compile_only
    # jax asks the local GPU's compute capability before it builds a packed-layout or
    # MLA (v narrower than k) call, and this host has no GPU: answer for the
    # compile-only target instead (an H200, sm_90), so the program is the device's.
    from jax._src.cudnn import fused_attention_stablehlo

    def target_has(capability: str) -> bool:
        return tuple(int(x) for x in capability.split(".")) <= TARGET_CAPABILITY

    fused_attention_stablehlo.check_compute_capability = target_has


def compile_row(name: str, overrides: dict, args) -> tuple[str, dict]:
    """The row's HLO path (compiled now, or reused from --keep) and its compile facts
    {compile_s, compiled_gib, batch}, kept beside the HLO as compile.json."""
    folder = name + ("-cudnn" if args.cudnn else "")
    keep = os.path.join(args.keep, folder) if args.keep else tempfile.mkdtemp(prefix="gpu_est_")
    hlo, facts = os.path.join(keep, "aot_h200-1.hlo"), os.path.join(keep, "compile.json")
    if args.reuse and os.path.exists(hlo):
        if os.path.exists(facts):
            with open(facts) as f:
                return hlo, json.load(f)
        config = make_config(overrides)
        batch = int(config.per_device_batch_size * config.gradient_accumulation_steps)
        return hlo, {"compile_s": 0.0, "compiled_gib": None, "batch": batch}
    start = time.perf_counter()
    if name == "reference":
        gib, batch = compile_reference(overrides, hlo, "cudnn" if args.cudnn else None)
    else:
        config = make_config(
            {"base_output_directory": keep, "compile_topology": "h200-1", **overrides}
        )
        result = aot.compile_for_topology(config, hlo)
        gib, batch = result.memory["total"] / bl.GIB, result.run.batch_size
    out = {
        "compile_s": time.perf_counter() - start,
        "compiled_gib": gib,
        "batch": batch,
        "overrides": overrides,
        "tree": bl.revision(),
    }
    with open(facts, "w") as f:
        json.dump(out, f)
    return hlo, out


def compile_reference(overrides: dict, hlo: str, implementation: str | None) -> tuple[float, int]:
    """The dense reference's step at the shape device_check gives it (the trainer
    shape `overrides` names, per_device_batch_size x GA sequences in one step),
    compiled for one compile-only H200 with XLA's attention (`implementation` None;
    "cudnn" under --cudnn); its HLO and thunk files written as a trainer row's are.
    Returns (compiled GiB, sequences per step)."""
    config = make_config(overrides)
    shape = dense_reference.shape_for(config.model, config.data)
    batch = int(config.per_device_batch_size * config.gradient_accumulation_steps)
    device = gpu_topology.devices("h200", 1, 1)[0]
    seq = config.data.max_target_length
    lowered = dense_reference.lower(shape, batch, seq, implementation, device)
    os.makedirs(os.path.dirname(hlo), exist_ok=True)
    dump = tempfile.mkdtemp(prefix="gpu_est_dump_")
    try:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        text = compiled.as_text()
        with open(hlo, "w") as f:
            f.write(text)
        gpu_topology.kernels_of_dump(dump, text, hlo.removesuffix(".hlo") + ".thunks.txt")
    finally:  # the dump (LLVM IR, PTX) is large: only the thunk files are kept
        shutil.rmtree(dump, ignore_errors=True)
    return aot.memory_of(compiled)["total"] / bl.GIB, batch


def reference_flops(overrides: dict) -> float:
    """The dense reference's training FLOPs per step at the shape of `overrides`."""
    config = make_config(overrides)
    shape = dense_reference.shape_for(config.model, config.data)
    seq = config.data.max_target_length
    batch = int(config.per_device_batch_size * config.gradient_accumulation_steps)
    return dense_reference.flops_per_token(shape, seq) * batch * seq


def estimate_row(name: str, title: str, overrides: dict, args) -> dict:
    """One row: compile, estimate, MFU, memory."""
    hlo, facts = compile_row(name, overrides, args)
    if name == "reference":
        hlo_text, sequence, metadata = hlo_tools.read_program(hlo)
        kernels = hlo_tools.launched_kernels(sequence, metadata, hlo_text, REFERENCE_ATTENTION)
        model_flops = reference_flops(overrides)
    else:
        kernels = tg.kernels_of_files(hlo)
        model_flops = tg.flops_per_step(make_config(overrides), int(facts["batch"]))
    est = hlo_tools.estimate_step(kernels, tg.roofline("h200"))
    mfu = model_flops / (est.total_ms * 1e-3 * tg.roofline("h200").peak_flops)
    memory, seconds = facts["compiled_gib"], facts["compile_s"]
    print(f"{name}: {est.total_ms:,.1f} ms, MFU {100 * mfu:.1f}%, {seconds:.0f} s", flush=True)
    row = {
        "row": name,
        "title": title,
        "overrides": " ".join(f"{k}={v}" for k, v in overrides.items()),
        "kernels_per_step": est.launches,
        "predicted_ms": est.total_ms,
        "mfu": mfu,
        "compiled_gib": memory,
        "compile_s": seconds,
        "tree": facts.get("tree", bl.revision()),
        **{f"ms_{cat}": ms for cat, (_, _, ms) in est.by_category.items()},
        "_estimate": est,
        "_hlo": hlo,
    }
    # The same shape compiled with cuDNN's attention (--cudnn), kept beside the row:
    # the device's own program, its conditional (packed call or masked fallback)
    # priced both ways. The calibration row has its own check (calibration_lines).
    cudnn = os.path.join(args.keep, f"{name}-cudnn") if args.keep else ""
    if (
        name not in ("calibration", "reference")
        and not args.cudnn
        and os.path.exists(f"{cudnn}/aot_h200-1.hlo")
    ):
        kernels = tg.kernels_of_files(f"{cudnn}/aot_h200-1.hlo")
        picks = [hlo_tools.estimate_step(kernels, tg.roofline("h200"), p) for p in (min, max)]
        with open(f"{cudnn}/compile.json") as f:
            row["_cudnn"] = (*picks, json.load(f).get("tree", "?"))
    return row


def calibration_lines(row: dict, truth: dict, args) -> list[str]:
    """The check against the measured run, per profile group, and the held-out path."""
    est = row["_estimate"]
    predicted = est.by_group()
    lines = [
        "## Calibration check",
        "",
        f"Measured: {truth['source']}. Predicted: the deviceless compile of the same shape "
        f"({row['title']}) at {row['tree']}, a tree whose program is the device run's (a "
        "later tree compiles a different program: `--keep DIR --reuse` takes the kept one).",
        "",
    ]
    step = truth["step_ms"]
    if step:
        off = 100 * (est.total_ms / step - 1)
        lines.append(
            f"- step: predicted {est.total_ms:,.1f} ms vs measured {step:,.1f} ms ({off:+.1f}%); "
            f"measured kernel time {truth['kernel_ms']:,.1f} ms"
        )
    if truth["kernels"]:
        lines.append(
            f"- kernels per step: {est.launches:,} in the thunk sequence vs "
            f"{truth['kernels']:,} profiled"
        )
    if truth["xla_attention_ms"] and not args.cudnn:
        xla = hlo_tools.launched_kernels(*_texts(row["_hlo"]), (), tg.THROUGH)
        held = hlo_tools.estimate_step(xla, tg.roofline("h200")).total_ms
        off = 100 * (held / truth["xla_attention_ms"] - 1)
        lines.append(
            f"- held out (not fitted): the same program with XLA's attention "
            f"(attention=dot_product on the device) predicted {held:,.1f} ms vs measured "
            f"{truth['xla_attention_ms']:,.1f} ms ({off:+.1f}%)"
        )
    # The same shape compiled with cuDNN's attention (--cudnn, kept beside this row):
    # the program the device ran, priced with the same calibration.
    cudnn_hlo = os.path.join(args.keep, "calibration-cudnn", "aot_h200-1.hlo") if args.keep else ""
    cudnn = None
    if not args.cudnn and os.path.exists(cudnn_hlo):
        cudnn = hlo_tools.estimate_step(tg.kernels_of_files(cudnn_hlo), tg.roofline("h200"))
        if step:
            off = 100 * (cudnn.total_ms / step - 1)
            lines.append(
                "- cross-check: the same shape compiled with cuDNN's attention on this host "
                f"(`--cudnn`, the device's program) predicted {cudnn.total_ms:,.1f} ms "
                f"({off:+.1f}%); the attention rate is fitted to its cuDNN calls' FLOPs "
                "(v zero-padded to q's head dim), so the XLA attention standing in for them, "
                "v at its own, is priced under the measured attention time"
            )
    lines.append("")
    body = []
    for group in dict.fromkeys([*truth["groups"], *predicted]):
        m, p = truth["groups"].get(group), predicted.get(group, 0.0)
        cells = [group, f"{m:,.1f}" if m is not None else "-", f"{p:,.1f}"]
        if cudnn is not None:
            cells.append(f"{cudnn.by_group().get(group, 0.0):,.1f}")
        body.append(cells)
    columns = ["profile group", "measured ms", "predicted ms"]
    columns += ["predicted, cuDNN compile"] if cudnn is not None else []
    lines += bl.table(columns, body) + [""]
    if args.refit:
        # The attention rate is fitted to the FLOPs the device's cuDNN kernels ran: the
        # cuDNN compile's (kept beside this row) where present, since the stand-in's
        # XLA attention keeps v at its own head dim where that call zero-padded it.
        fitted = hlo_tools.fit_calibration(
            est.kernels,
            truth["groups"],
            tg.roofline("h200"),
            source=truth["source"],
            device_attention=cudnn.kernels if cudnn is not None else None,
        )
        print(f"refit: {fitted!r}", flush=True)
        refit = hlo_tools.estimate_step(est.kernels, ge.Roofline(*_chip(), fitted))
        lines.append(f"Refit (--refit): predicted {refit.total_ms:,.1f} ms with {fitted!r}")
        lines.append("")
    return lines


def _chip() -> tuple[float, float]:
    r = tg.roofline("h200")
    return r.peak_flops, r.hbm_bandwidth


def _texts(hlo_path: str) -> tuple[str, str, str]:
    hlo, sequence, metadata = hlo_tools.read_program(hlo_path)
    return sequence, metadata, hlo


def row_lines(row: dict) -> list[str]:
    """A row's split by category and its costliest source lines."""
    est = row["_estimate"]
    lines = [f"## {row['row']}: {row['title']}", ""]
    lines.append(
        f"Predicted {est.total_ms:,.1f} ms per step, MFU {100 * row['mfu']:.1f}%, "
        f"{est.launches:,} kernels per step, {est.flops / 1e12:,.1f} matmul TFLOP per step "
        f"(overrides: {row['overrides']})."
    )
    lines.append("")
    body = [
        [cat, f"{n:,}", f"{b / 1e9:,.1f}", f"{ms:,.1f}"]
        for cat, (n, b, ms) in est.by_category.items()
    ]
    lines += bl.table(["category", "kernels/step", "GB/step", "ms"], body) + [""]
    if row.get("measured_ms"):
        off = 100 * (est.total_ms / row["measured_ms"] - 1)
        lines += [
            f"Held out (the calibration was not fitted to it): predicted {est.total_ms:,.1f} "
            f"ms vs {row['measured_ms']:,.1f} ms measured in the calibration's device run "
            f"({off:+.1f}%; device_check.md, whose versions may differ from this host's). "
            "Its MFU counts dense_reference.flops_per_token; its compiled GiB is the XLA "
            "attention's (scores in memory), which the device ran as cuDNN's.",
            "",
        ]
    body = [
        [
            f"`{g.source}`",
            f"{g.launches:,}",
            f"{g.bytes / 1e9:,.1f}",
            f"{g.flops / 1e12:,.2f}",
            ", ".join(g.categories),
            f"{g.ms:,.1f}",
        ]
        for g in est.groups[:TOP]
    ]
    columns = ["source line", "kernels/step", "GB/step", "TFLOP/step", "categories", "ms"]
    lines += bl.table(columns, body, "lrrrlr") + [""]
    if "_cudnn" in row:
        cheap, dear, tree = row["_cudnn"]
        lines += [
            "Cross-check: the same shape compiled with cuDNN's attention on this host "
            f"(`--cudnn`, the device's program, compiled at {tree}): {cheap.total_ms:,.1f} ms "
            f"({cheap.launches:,} kernels) with each conditional's cheaper branch, cuDNN's "
            "packed call (the branch rows of at most "
            f"{cudnn_attention.MAX_DOCUMENTS} documents take); {dear.total_ms:,.1f} ms with "
            "the costlier one, the masked fallback (what the estimate of a program with "
            "conditionals prices).",
            "",
        ]
    return lines


def page(rows: list[dict], truth: dict, args, wall: float) -> list[str]:
    cal = ge.CALIBRATION
    notes = [
        "chip: one H200 (989 dense bf16 TFLOP/s, 4.8 TB/s; trainer/run/gpu_topology.py), "
        "compiled on this host for a compile-only GPU (no GEMM autotuning, XLA's attention "
        "priced as cuDNN's: hlo_tools/gpu_estimate.py says what the estimate cannot see)",
        f"calibration (hlo_tools.gpu_estimate.CALIBRATION): {cal.source}; HBM at "
        f"{cal.hbm_efficiency:.0%}, matmuls at {cal.matmul_efficiency:.0%} of peak from "
        f"{cal.matmul_full_flops / 1e9:.0f} GFLOP, {cal.launch_s * 1e6:.0f} us per launch, "
        f"cuDNN attention at {cal.attention_efficiency:.1%} of peak",
        "MFU: trainer.model.flops (6 x active matmul params + attention) per step over "
        "predicted time x peak",
        bl.compiles_note(rows, wall, reuse=args.reuse),
    ]
    if args.layers:
        notes.append(f"models cut to {args.layers} decoder layers (--layers)")
    if args.cudnn:
        notes.append(
            "--cudnn: cuDNN's attention compiled on this host (nvidia-cudnn wheel), its "
            "custom calls priced as the XLA attention they replace"
        )
    if args.set:
        notes.append("extra keys (--set): " + " ".join(args.set))
    columns = ["row", "kernels/step", "predicted ms", "MFU", "compiled GiB", "compile s"]
    body = [
        [
            f"{r['row']}: {r['title']}",
            f"{r['kernels_per_step']:,}",
            f"{r['predicted_ms']:,.1f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['compiled_gib']:.1f}" if r["compiled_gib"] is not None else "-",
            f"{r['compile_s']:.0f}",
        ]
        for r in rows
    ]
    title = "GPU step time predicted from the compiled program (one H200, no device)"
    lines = bl.header(title, COMMAND + _flags(args), notes) + bl.table(columns, body) + [""]
    for r in rows:
        if r["row"] == "calibration":
            lines += calibration_lines(r, truth, args)
        lines += row_lines(r)
    return lines


def _flags(args) -> str:
    flags = [f" --only {n}" for n in args.only or []]
    flags += [f" --layers {args.layers}"] if args.layers else []
    flags += [" --cudnn"] if args.cudnn else []
    return "".join(flags + [f" --set {s}" for s in args.set])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", choices=list(ROWS), help="row (repeatable)")
    p.add_argument("--layers", type=int, default=0, help="cut the models to N decoder layers")
    p.add_argument("--set", action="append", default=[], help="key=value for every row")
    p.add_argument("--keep", default="", help="keep each row's compiled files under DIR")
    p.add_argument("--reuse", action="store_true", help="reuse --keep's files where present")
    p.add_argument("--refit", action="store_true", help="refit the calibration (calibration row)")
    p.add_argument("--out", default="", help="page directory")
    p.add_argument("--cudnn", action="store_true", help="compile cuDNN's attention (see above)")
    args = p.parse_args(argv)
    for item in args.set:
        if "=" not in item:
            p.error(f"--set {item!r}: expected key=value")
    if args.reuse and not args.keep:
        p.error("--reuse needs --keep DIR")
    if not args.out:
        scratch = args.only or args.layers or args.set or args.cudnn
        args.out = os.path.join(tempfile.gettempdir(), "gpu_estimate") if scratch else bl.RESULTS
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.cudnn:
        allow_cudnn_deviceless()
    extra = dict(item.split("=", 1) for item in args.set)
    if args.layers:
        extra["base_num_decoder_layers"] = str(args.layers)
    truth = measured()
    rows, start = [], time.perf_counter()
    for name in args.only or list(ROWS):
        title, overrides = ROWS[name]
        if name == "calibration":  # the measured run's own keys
            overrides = truth["overrides"]
        rows.append(estimate_row(name, title, {**overrides, **extra}, args))
        if name == "reference":  # device_check timed it in the calibration's run
            rows[-1]["measured_ms"] = truth["reference_ms"]
        flat = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        bl.write("gpu_estimate", page(rows, truth, args, time.perf_counter() - start), flat,
                 args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
