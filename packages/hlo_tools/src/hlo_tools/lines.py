"""Line-level helpers: split a dump at the entry computation's loops, size all-reduces."""

from __future__ import annotations

from collections.abc import Iterable

from hlo_tools.callgraph import call_graph
from hlo_tools.collectives import collective_kind
from hlo_tools.errors import HloParseError
from hlo_tools.module import HloModule
from hlo_tools.parser import parse, parse_instruction
from hlo_tools.replica_groups import parse_replica_groups
from hlo_tools.shapes import leaf_arrays


def split_by_entry_loop(text: str | HloModule) -> tuple[list[str], list[str]]:
    """Split the instruction lines into (inside the entry's while loops, outside them).

    Inside: every instruction of a computation reached from ENTRY through at
    least one while body or condition (including fusions, calls and reducers
    called from there). Outside: every other instruction line, including the
    ``while`` instructions themselves. Computations not reachable from ENTRY
    count as outside. Raises :class:`HloParseError` on malformed text.
    """
    module = text if isinstance(text, HloModule) else parse(text)
    contexts = call_graph(module).contexts
    inside, outside = [], []
    for comp in module.computations.values():
        looped = any(ctx.loops for ctx in contexts.get(comp.name, []))
        (inside if looped else outside).extend(i.line for i in comp.instructions)
    return inside, outside


def cross_replica_all_reduce_sizes(lines: Iterable[str]) -> list[int]:
    """Element counts of the cross-replica all-reduces (and ``all-reduce-start``s) among ``lines``.

    An all-reduce whose replica groups are all single devices is a no-op and is
    skipped; ``{}`` and unparseable-but-present groups count as cross-replica.
    Lines that are not instructions (headers, ``}``) are ignored; an
    all-reduce line that does not parse raises :class:`HloParseError`.
    """
    sizes = []
    for number, line in enumerate(lines, start=1):
        if "all-reduce" not in line or "=" not in line:
            continue
        try:
            instr = parse_instruction(line, number)
        except HloParseError:
            # Only a line whose opcode is an all-reduce must parse; anything else
            # (a computation header naming an all-reduce, say) is not ours.
            if any(f" {op}(" in line for op in ("all-reduce", "all-reduce-start")):
                raise
            continue
        if collective_kind(instr.opcode) != "all-reduce":
            continue
        value = instr.attributes.get("replica_groups")
        groups = parse_replica_groups(value, number) if value is not None else None
        if groups is not None and all(len(g) <= 1 for g in groups):
            continue
        sizes.append(sum(a.elements for a in leaf_arrays(instr.type)))
    return sizes
