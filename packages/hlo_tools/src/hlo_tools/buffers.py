"""XLA's buffer assignment: which values share memory, and which live across loop iterations.

The compiled HLO says what runs; the buffer assignment (written beside it by
``--xla_dump_to`` as ``*after_optimizations-buffer-assignment.txt``) says where
each value lives: allocations (parameters, outputs, the temp arena) and, in each,
the values at their offsets. A value XLA marks ``(phi)`` is a loop-carried
state of a ``while``: the buffers such values occupy are the memory a loop holds
from one iteration to the next.

That is what tells a gradient accumulator apart from a per-microbatch gradient:
a plain accumulation loop carries the accumulator *and*, in its backward layer
scan, the stacked gradient of the current microbatch (two buffers of the
parameter's shape); accumulating inside the backward scan carries one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from hlo_tools.errors import HloParseError

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE = re.compile(
    r"^\s*value: <\d+ (?P<name>\S+)(?P<phi> \(phi\))? @\d+> "
    r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>.*)$"
)
_LAYOUT = re.compile(r"\{[^{}]*\}")


@dataclasses.dataclass(frozen=True)
class BufferValue:
    """One HLO value in an allocation. ``shape`` has no layout (``f32[8,256]``)."""

    name: str
    size: int
    offset: int
    shape: str
    loop_carried: bool


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One buffer allocation: ``kind`` is XLA's description (``preallocated-temp``,
    ``parameter 0, shape |f32[4]| at ShapeIndex {}``, ``maybe-live-out``, ...)."""

    index: int
    size: int
    kind: str
    values: tuple[BufferValue, ...]


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """The allocations of a buffer-assignment dump, in file order.

    Raises HloParseError when the text holds no allocation (not a buffer
    assignment: the HLO module itself, say).
    """
    allocations: list[Allocation] = []
    header: tuple[int, int, str] | None = None
    values: list[BufferValue] = []
    for line in text.splitlines():
        found = _ALLOCATION.match(line)
        if found:
            if header is not None:
                allocations.append(Allocation(*header, tuple(values)))
            header, values = (int(found[1]), int(found[2]), found[3]), []
            continue
        value = _VALUE.match(line)
        if value and header is not None:
            values.append(
                BufferValue(
                    name=value["name"],
                    size=int(value["size"]),
                    offset=int(value["offset"]),
                    shape=_LAYOUT.sub("", value["shape"]).strip(),
                    loop_carried=bool(value["phi"]),
                )
            )
        elif header is not None and not line.startswith((" ", "\t")) and line.strip():
            # The allocation list ends where the next section starts.
            allocations.append(Allocation(*header, tuple(values)))
            header, values = None, []
    if header is not None:
        allocations.append(Allocation(*header, tuple(values)))
    if not allocations:
        raise HloParseError("no 'allocation N: size S, ...' line: not a buffer-assignment dump")
    return allocations


def loop_buffers(text_or_allocations: str | Iterable[Allocation]) -> dict[str, int]:
    """Array shape -> how many distinct buffers (allocation, offset) hold loop-carried
    values of that shape: the memory loops keep across iterations, per shape.

    Tuple-shaped values (a while loop's whole state) are left out: their
    elements are counted one by one.
    """
    allocations = (
        parse_buffer_assignment(text_or_allocations)
        if isinstance(text_or_allocations, str)
        else text_or_allocations
    )
    slots: dict[str, set[tuple[int, int]]] = {}
    for allocation in allocations:
        for value in allocation.values:
            if value.loop_carried and not value.shape.startswith("("):
                slots.setdefault(value.shape, set()).add((allocation.index, value.offset))
    return {shape: len(found) for shape, found in sorted(slots.items())}
