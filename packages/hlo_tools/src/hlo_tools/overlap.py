"""Per collective: is it asynchronous, and is compute scheduled between its start and done.

Reads the schedule (`hlo_tools.schedule`): a collective is asynchronous when a
start issues it, and hidden (``overlapped``) when compute is scheduled between
that start and its done. Bytes per step are the collective records' own,
weighted by the enclosing loops' trip counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hlo_tools.assertions import is_gradient_reduction
from hlo_tools.collectives import Collective, collectives
from hlo_tools.module import HloModule, Instruction
from hlo_tools.parser import parse
from hlo_tools.report import human_bytes
from hlo_tools.schedule import async_pairs, is_start


@dataclass(frozen=True)
class Overlap:
    """One collective record and how it is scheduled.

    ``start``/``done`` name the instructions issuing and awaiting it in
    ``computation`` (``start`` is the collective itself when it is
    synchronous; ``done`` is None then, or when the done is outside that
    computation). ``between`` names the compute instructions scheduled between
    them.
    """

    collective: Collective
    is_async: bool
    start: str
    done: str | None
    computation: str
    between: tuple[str, ...]

    @property
    def overlapped(self) -> bool:
        """Asynchronous with compute scheduled between its start and done."""
        return self.is_async and bool(self.between)

    @property
    def kind(self) -> str:
        """The collective's kind (``all-reduce``, ...)."""
        return self.collective.kind

    @property
    def bytes(self) -> int:
        """Bytes per execution."""
        return self.collective.bytes

    @property
    def bytes_per_step(self) -> int | None:
        """Bytes per step (trip-count weighted); None under a loop of unknown trip count."""
        return self.collective.bytes_per_step


def async_overlap(module: HloModule | str) -> list[Overlap]:
    """One :class:`Overlap` per collective record (``collectives(module)``, same order).

    A collective is asynchronous when it is a ``-start`` op, or sits in the
    computation an ``async-start`` or a TPU async collective start fusion
    calls (through nested fusions); its start and done are then read in the
    computation that schedules them, inside a loop body for a collective in a loop.
    """
    if isinstance(module, str):
        module = parse(module)
    pairs = async_pairs(module)
    callers = {
        (instr.name, callee): instr
        for instr in module.instructions()
        for _, callee in instr.called()
    }
    out = []
    for c in collectives(module):
        start = _issuer(module, c, callers)
        if start is None:
            out.append(Overlap(c, False, c.name, None, c.computation, ()))
            continue
        pair = pairs[(start.computation, start.name)]
        out.append(Overlap(c, True, start.name, pair.done, start.computation, pair.between))
    return out


def _issuer(module: HloModule, c: Collective, callers: dict) -> Instruction | None:
    """The start that issues the collective, walking up through fusions; None if synchronous."""
    instr = module.computations[c.computation].by_name[c.name]
    if is_start(module, instr):
        return instr
    callee = c.computation
    for name in reversed(c.via):
        caller = callers.get((name, callee))
        if caller is None:
            return None
        if is_start(module, caller):
            return caller
        if caller.opcode != "fusion":
            return None
        callee = caller.computation
    return None


def wire_bytes(c: Collective) -> int:
    """Bytes each device sends for one execution of `c`, by the ring algorithm:
    all-reduce 2(n-1)/n of its array, reduce-scatter (n-1) shards, all-gather and
    all-to-all (n-1)/n, a collective-permute its array (n: the group size; the
    array itself when it is unknown).

    The measure that weighs a gradient alike however it is reduced: one
    all-reduce, a reduce-scatter, or a ring of collective-permutes (accum.ring).
    """
    n = c.group_size
    if c.kind == "collective-permute" or not n or n < 2:
        return c.bytes
    if c.kind == "all-reduce":
        return 2 * (n - 1) * c.bytes // n
    if c.kind == "reduce-scatter":
        return (n - 1) * c.bytes
    return (n - 1) * c.bytes // n


def overlap_summary(records: Iterable[Overlap]) -> dict:
    """Counts and bytes per step of the records: all, asynchronous, overlapped.

    ``{"count", "async", "overlapped", "bytes_per_step", "async_bytes_per_step",
    "overlapped_bytes_per_step", "share", "wire_bytes_per_step",
    "overlapped_wire_bytes_per_step", "wire_share", "exact"}``; ``share`` is the
    overlapped part of the bytes per step (None without bytes), ``wire_share``
    the same part of `wire_bytes` per step (what to compare across reductions of
    different kinds: a reduce-scatter's bytes are its shard, a ring's permutes
    move n-1 of them). A record under a loop of unknown trip count counts once
    and turns ``exact`` False.
    """
    out = {
        "count": 0,
        "async": 0,
        "overlapped": 0,
        "bytes_per_step": 0,
        "async_bytes_per_step": 0,
        "overlapped_bytes_per_step": 0,
        "wire_bytes_per_step": 0,
        "overlapped_wire_bytes_per_step": 0,
        "exact": True,
    }
    for r in records:
        per_step = r.bytes_per_step
        if per_step is None:
            out["exact"], per_step = False, r.bytes
        wire = wire_bytes(r.collective) * (per_step // r.bytes if r.bytes else 0)
        out["count"] += 1
        out["bytes_per_step"] += per_step
        out["wire_bytes_per_step"] += wire
        if r.is_async:
            out["async"] += 1
            out["async_bytes_per_step"] += per_step
        if r.overlapped:
            out["overlapped"] += 1
            out["overlapped_bytes_per_step"] += per_step
            out["overlapped_wire_bytes_per_step"] += wire
    total, wire_total = out["bytes_per_step"], out["wire_bytes_per_step"]
    out["share"] = out["overlapped_bytes_per_step"] / total if total else None
    out["wire_share"] = out["overlapped_wire_bytes_per_step"] / wire_total if wire_total else None
    return out


def overlap_report(module: HloModule | str, max_in_loop_elements: int = 8) -> dict:
    """``{"gradient_reductions": summary, "all": summary, "collectives": [...]}``.

    Gradient reductions are :func:`is_gradient_reduction` records; each
    collective row gives name, kind, bytes, bytes per step, async, start,
    done and the number of compute ops between.
    """
    records = async_overlap(module)
    reductions = [r for r in records if is_gradient_reduction(r.collective, max_in_loop_elements)]
    return {
        "gradient_reductions": overlap_summary(reductions),
        "all": overlap_summary(records),
        "collectives": [
            {
                "name": r.collective.name,
                "kind": r.kind,
                "bytes": r.bytes,
                "bytes_per_step": r.bytes_per_step,
                "async": r.is_async,
                "start": r.start,
                "done": r.done,
                "computation": r.computation,
                "compute_between": len(r.between),
            }
            for r in records
        ],
    }


def format_overlap(report: dict) -> str:
    """One line from :func:`overlap_report`: the share of bytes per step issued
    asynchronously with compute between start and done, for gradient reductions and all."""

    def part(label: str, s: dict) -> str:
        if not s["count"]:
            return f"{label}: none"
        share = f"{100 * s['share']:.1f}%" if s["share"] is not None else "-"
        plus = "" if s["exact"] else "+"
        return (
            f"{label} {share} of {human_bytes(s['bytes_per_step'])}{plus}/step "
            f"({s['overlapped']} of {s['count']}, {s['async']} async)"
        )

    return (
        "overlapped (async, compute between start and done): "
        + part("gradient reductions", report["gradient_reductions"])
        + "; "
        + part("all collectives", report["all"])
    )
