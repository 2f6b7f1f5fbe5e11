"""Find one XLA:GPU compile's files: its optimized HLO, thunk sequence and
thunk metadata, from an XLA dump directory (``--xla_dump_to``) or from the files
`train compile_topology=h200-1` keeps (``aot_h200-1.hlo`` with
``aot_h200-1.thunks.txt`` and ``aot_h200-1.thunk_metadata.txt`` beside it)."""

from __future__ import annotations

import glob
import os

_SEQUENCE = ".thunk_sequence.txt"
_OPTIMIZED = "after_optimizations.txt"


def program_files(path: str) -> tuple[str, str, str]:
    """(HLO path, thunk sequence path, thunk metadata path) of the program at `path`.

    A directory is an XLA dump: its largest thunk sequence (the train step; a
    dump holds every module compiled while it was set) and that module's
    optimized HLO. A file is an HLO text whose ``.thunks.txt`` and
    ``.thunk_metadata.txt`` lie beside it (``x.hlo`` -> ``x.thunks.txt``).
    FileNotFoundError names what is missing."""
    if os.path.isdir(path):
        sequences = glob.glob(os.path.join(path, "*" + _SEQUENCE))
        if not sequences:
            raise FileNotFoundError(f"{path}: no *{_SEQUENCE} (was it dumped by XLA:GPU?)")
        sequence = max(sequences, key=os.path.getsize)
        stem = sequence.removesuffix(_SEQUENCE)
        hlos = [p for p in glob.glob(stem + "*" + _OPTIMIZED) if "buffer" not in p]
        if not hlos:
            raise FileNotFoundError(f"{stem}*{_OPTIMIZED}: the module's optimized HLO is missing")
        files = (min(hlos, key=len), sequence, stem + ".thunk_metadata.txt")
    else:
        stem = path.removesuffix(".hlo")
        files = (path, stem + ".thunks.txt", stem + ".thunk_metadata.txt")
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file}: not found")
    return files


def read_program(path: str) -> tuple[str, str, str]:
    """The texts of `program_files(path)`: (HLO, thunk sequence, thunk metadata)."""
    texts = []
    for file in program_files(path):
        with open(file, encoding="utf-8") as f:
            texts.append(f.read())
    return texts[0], texts[1], texts[2]
