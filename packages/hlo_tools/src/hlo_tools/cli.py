"""``hlo-report FILE|-``: where every collective runs, how big, how often;
``hlo-report --gpu DIR|FILE``: an XLA:GPU program's predicted step time."""

from __future__ import annotations

import argparse
import json
import math
import sys

from hlo_tools.collectives import KINDS, collectives
from hlo_tools.errors import HloParseError
from hlo_tools.gpu_estimate import CHIPS, Roofline, estimate_step, format_estimate
from hlo_tools.gpu_files import read_program
from hlo_tools.gpu_kernels import launched_kernels
from hlo_tools.overlap import format_overlap, overlap_report
from hlo_tools.parser import parse
from hlo_tools.report import format_table, to_json, verdict
from hlo_tools.slices import format_slice_traffic, slice_traffic


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hlo-report``."""
    p = argparse.ArgumentParser(
        prog="hlo-report",
        description="Collectives of a compiled HLO dump by loop nesting and kind, "
        "with bytes per step and a verdict on in-loop gradient reductions.",
    )
    p.add_argument("file", help="HLO text file (compiled.as_text()), or - for stdin")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kind", action="append", choices=KINDS, help="only this kind (repeatable)")
    p.add_argument(
        "--min-bytes", type=int, default=0, help="only collectives moving >= this many bytes"
    )
    p.add_argument(
        "--max-in-loop-elements",
        type=int,
        default=8,
        help="in-loop reductions up to this size are allowed by the verdict (default 8)",
    )
    p.add_argument(
        "--mesh",
        help="the mesh's axes in order, e.g. data=4,fsdp=2 (device ids are mesh positions); "
        "with --over, the verdict judges only reductions across those axes",
    )
    p.add_argument(
        "--over",
        action="append",
        default=[],
        help="a mesh axis no in-loop reduction may span, e.g. data (repeatable; needs --mesh). "
        "Reductions over other axes only (FSDP's own reduce-scatters) are allowed",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=1,
        help="the program spans this many slices (contiguous blocks of device ids, the "
        "cross-slice mesh axes outermost): also split bytes per step into cross-slice and in-slice",
    )
    p.add_argument("--details", action="store_true", help="also list every collective")
    p.add_argument("--check", action="store_true", help="exit 1 unless the verdict is OK")
    gpu = p.add_argument_group(
        "GPU step-time estimate (hlo_tools.gpu_estimate; FILE: an XLA dump directory, or an "
        "HLO file with its .thunks.txt and .thunk_metadata.txt beside it)"
    )
    gpu.add_argument("--gpu", action="store_true", help="print the estimate instead")
    gpu.add_argument("--chip", choices=sorted(CHIPS), default="h200", help="default h200")
    gpu.add_argument("--top", type=int, default=5, help="costliest source lines listed")
    gpu.add_argument(
        "--model-flops", type=float, help="the model's FLOPs per step per device (prints MFU)"
    )
    gpu.add_argument(
        "--attention-function",
        action="append",
        default=[],
        help="a function (as the HLO names it, e.g. MLA._dot_product) whose kernels run as "
        "cuDNN attention on the device (repeatable)",
    )
    gpu.add_argument(
        "--through",
        action="append",
        default=[],
        help="a helper function source lines look past to its caller (repeatable)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for unreadable or malformed input)."""
    args = build_parser().parse_args(argv)
    if args.gpu:
        return _gpu(args)
    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        module = parse(text)
    except (OSError, HloParseError) as e:
        print(f"hlo-report: {args.file}: {e}", file=sys.stderr)
        return 2
    try:
        if args.slices < 1 or (module.num_devices or args.slices) % args.slices:
            raise ValueError(f"--slices {args.slices} does not divide the program's devices")
        # A multi-slice TPU program is one slice's: its mesh spans `--slices` of it.
        program_devices = module.num_devices
        if program_devices and args.slices > 1 and any(c.cross_slice for c in collectives(module)):
            program_devices *= args.slices
        mesh_shape = _mesh_shape(args.mesh, program_devices)
        judged = verdict(module, args.max_in_loop_elements, mesh_shape, args.over)
    except ValueError as e:
        print(f"hlo-report: {e}", file=sys.stderr)
        return 2
    if args.json:
        data = to_json(
            module, args.kind, args.min_bytes, args.max_in_loop_elements, mesh_shape, args.over
        )
        if args.slices > 1:
            data["slice_traffic"] = slice_traffic(module, args.slices)
        data["overlap"] = overlap_report(module, args.max_in_loop_elements)
        print(json.dumps(data, indent=2))
    else:
        print(
            format_table(
                module,
                args.kind,
                args.min_bytes,
                args.max_in_loop_elements,
                args.details,
                verdict_line=False,
            )
        )
        if args.slices > 1:
            print(
                f"{args.slices} slices: {format_slice_traffic(slice_traffic(module, args.slices))}"
            )
        print(format_overlap(overlap_report(module, args.max_in_loop_elements)))
        print(judged["message"])
    if args.check and judged["status"] != "OK":
        return 1
    return 0


def _gpu(args: argparse.Namespace) -> int:
    """``--gpu``: the estimate's report lines."""
    try:
        hlo, sequence, metadata = read_program(args.file)
        found = launched_kernels(
            sequence, metadata, hlo, tuple(args.attention_function), tuple(args.through)
        )
    except (OSError, HloParseError) as e:
        print(f"hlo-report: {args.file}: {e}", file=sys.stderr)
        return 2
    peak, bandwidth = CHIPS[args.chip]
    est = estimate_step(found, Roofline(peak, bandwidth))
    for line in format_estimate(est, args.top, args.model_flops, peak):
        print(line)
    return 0


def _mesh_shape(text: str | None, num_devices: int | None) -> dict[str, int] | None:
    """``data=4,fsdp=2`` -> {"data": 4, "fsdp": 2}; ValueError naming a bad entry."""
    if not text:
        return None
    shape: dict[str, int] = {}
    for entry in text.split(","):
        name, _, size = entry.partition("=")
        if not name or not size.isdigit() or int(size) < 1 or name in shape:
            raise ValueError(f"--mesh entry {entry!r}: expected AXIS=SIZE, each axis once")
        shape[name] = int(size)
    total = math.prod(shape.values())
    if num_devices and total != num_devices:
        raise ValueError(f"--mesh {text} has {total} devices; the program has {num_devices}")
    return shape


if __name__ == "__main__":
    sys.exit(main())
