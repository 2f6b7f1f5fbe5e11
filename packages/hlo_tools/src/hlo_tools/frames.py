"""The source lines XLA keeps for an instruction: where in the user's code it came from.

Newer XLA prints each instruction's call stack as ``metadata={... stack_frame_id=N}``
and the tables it points into at the top of the module (``FileNames``,
``FunctionNames``, ``FileLocations``, ``StackFrames``); older XLA prints
``source_file="..." source_line=N`` in the metadata itself. Both give a list of
``Frame``s, innermost first. Read against a compiled module whose whole chains
are known (a call from a script through a helper, down to the module level):
a ``StackFrames`` row's ``parent_frame_id`` is its parent's row id plus one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hlo_tools.module import Instruction

_SECTION = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$")
_NAME_ROW = re.compile(r'^(\d+)\s+"((?:[^"\\]|\\.)*)"$')
_FIELDS = re.compile(r"(\w+)=(-?\d+)")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)"\s+source_line=(\d+)')


@dataclass(frozen=True)
class Frame:
    """One call-stack entry: ``file:line (function)``."""

    file: str
    line: int
    function: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{where} ({self.function})" if self.function else where


class StackFrames:
    """The module's stack-frame tables, resolving ``stack_frame_id``s to frames."""

    def __init__(self, text: str):
        tables: dict[str, dict[int, object]] = {}
        section = None
        for raw in text.splitlines():
            line = raw.strip()
            if _SECTION.match(line):
                section = tables.setdefault(line, {})
                continue
            if not line or section is None:
                section = None
                continue
            row_id, _, rest = line.partition(" ")
            if not row_id.isdigit():
                section = None
                continue
            name = _NAME_ROW.match(line)
            section[int(row_id)] = name.group(2) if name else dict(_fields(rest))
        self._files = tables.get("FileNames", {})
        self._functions = tables.get("FunctionNames", {})
        self._locations = tables.get("FileLocations", {})
        self._frames = tables.get("StackFrames", {})

    def stack(self, frame_id: int) -> list[Frame]:
        """Frames of `frame_id` and its parents, innermost first ([] when unknown)."""
        out: list[Frame] = []
        seen: set[int] = set()
        while frame_id in self._frames and frame_id not in seen:
            seen.add(frame_id)
            row = self._frames[frame_id]
            location = self._locations.get(row.get("file_location_id", -1), {})
            out.append(
                Frame(
                    str(self._files.get(location.get("file_name_id", -1), "?")),
                    location.get("line", 0),
                    str(self._functions.get(location.get("function_name_id", -1), "")),
                )
            )
            # XLA prints the parent's id plus one (0 in the proto means none), so a
            # root frame names itself: step back by one, and 0 ends the chain.
            frame_id = row.get("parent_frame_id", 0) - 1
        return out

    def of(self, instr: Instruction) -> list[Frame]:
        """The instruction's call stack, innermost first: from ``stack_frame_id``,
        else from ``source_file``/``source_line``; [] when it has neither."""
        metadata = instr.attributes.get("metadata", "")
        found = _FRAME_ID.search(metadata)
        if found:
            return self.stack(int(found.group(1)))
        source = _SOURCE.search(metadata)
        return [Frame(source.group(1), int(source.group(2)))] if source else []


def _fields(text: str) -> list[tuple[str, int]]:
    return [(key, int(value)) for key, value in _FIELDS.findall(text)]
