"""Are two sets of compiled programs the same? Fingerprints of XLA's optimized HLO dumps.

A refactoring that must not change behaviour (issue 42) is checked by compiling the
same tests before and after it with XLA dumping every program, e.g.

    JAX_PLATFORMS=cpu XLA_FLAGS="--xla_backend_optimization_level=0 \\
      --xla_dump_to=/tmp/hlo_before --xla_dump_hlo_as_text" \\
      uv run pytest -q -n 1 -m "not aot and not integration and not slow" packages/accum/tests

and then comparing the two folders:

    python benchmarks/hlo_fingerprints.py /tmp/hlo_before /tmp/hlo_after

Each `*after_optimizations.txt` (the program XLA runs) is hashed without what
moving code changes but the program does not: the `metadata={...}` of every
instruction (op names, source files and lines, stack frame ids) and the debug
tables JAX prints before the first computation (FileNames, FunctionNames,
FileLocations, StackFrames). The folders hold the same programs when the two
multisets of hashes are equal; the exit status is 0 then, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import re
import sys
from pathlib import Path

# An instruction's metadata, quoted strings (which may hold braces) read whole.
_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
# A debug table's title line (FileNames, StackFrames, ...): the table runs to a blank line.
_TABLE_TITLE = re.compile(r"[A-Z][A-Za-z]*$")


def program_text(text: str) -> str:
    """The HLO text without instruction metadata and debug tables."""
    kept, in_table = [], False
    for line in text.splitlines():
        if in_table:
            in_table = bool(line.strip())
            continue
        if _TABLE_TITLE.match(line.rstrip()):
            in_table = True
            continue
        kept.append(_METADATA.sub("", line))
    return "\n".join(kept)


def fingerprints(folder: Path) -> dict[str, str]:
    """Dump file name -> hash of its program text, for every optimized module."""
    return {
        path.name: hashlib.sha256(program_text(path.read_text()).encode()).hexdigest()[:16]
        for path in sorted(folder.glob("*after_optimizations.txt"))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="an --xla_dump_to folder")
    parser.add_argument("after", type=Path, help="another one")
    args = parser.parse_args(argv)
    before, after = fingerprints(args.before), fingerprints(args.after)
    if not before or not after:
        print("no *after_optimizations.txt in one of the folders (--xla_dump_hlo_as_text?)")
        return 1
    counts = collections.Counter(before.values()), collections.Counter(after.values())
    for name, mine in (("before", before), ("after", after)):
        digest = hashlib.sha256("".join(sorted(mine.values())).encode()).hexdigest()[:16]
        print(f"{name}: {len(mine)} programs, {len(set(mine.values()))} distinct, {digest}")
    for label, extra in (
        ("only before", counts[0] - counts[1]),
        ("only after", counts[1] - counts[0]),
    ):
        for digest, n in extra.items():
            files = [
                f for f, d in (before if label == "only before" else after).items() if d == digest
            ]
            print(f"{label}: {digest} x{n}: {', '.join(files[:3])}")
    same = counts[0] == counts[1]
    print("same programs" if same else "the programs differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
