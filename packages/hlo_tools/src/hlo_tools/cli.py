"""``hlo-report FILE|-``: where every collective runs, how big, how often."""

from __future__ import annotations

import argparse
import json
import sys

from hlo_tools.collectives import KINDS
from hlo_tools.errors import HloParseError
from hlo_tools.parser import parse
from hlo_tools.report import format_table, to_json, verdict


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
    p.add_argument("--details", action="store_true", help="also list every collective")
    p.add_argument("--check", action="store_true", help="exit 1 unless the verdict is OK")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for unreadable or malformed input)."""
    args = build_parser().parse_args(argv)
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
    if args.json:
        data = to_json(module, args.kind, args.min_bytes, args.max_in_loop_elements)
        print(json.dumps(data, indent=2))
    else:
        print(
            format_table(module, args.kind, args.min_bytes, args.max_in_loop_elements, args.details)
        )
    if args.check and verdict(module, args.max_in_loop_elements)["status"] != "OK":
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
