"""Asynchronous collectives in a scheduled module: each start, its done, and the work between.

In a scheduled module (``is_scheduled=true``: every compiled module) the
instructions of a computation are printed in the order they run. An
asynchronous collective is issued by a start and waited for by a done; what
is scheduled between the two in the same computation can run while the data
moves. Three spellings of start and done are recognised:

- ``all-reduce-start`` / ``all-reduce-done`` (also all-gather, collective-permute,
  ...; ``send`` / ``send-done`` for megascale transfers): the done takes the start.
- ``async-start`` / ``async-done`` with ``calls=`` a computation holding the
  collective (reduce-scatter, all-to-all on GPU); ``async-update`` may sit between.
- TPU's async collective fusions: a ``fusion`` whose computation ends in the
  custom-call ``AsyncCollectiveStart``, continuation fusions that repeat the
  collective beside compute, and a ``fusion`` holding ``AsyncCollectiveDone``;
  the done reaches the start through the continuations' tuple outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hlo_tools.collectives import (
    KINDS,
    TPU_DONE,
    TPU_START,
    custom_call_target,
    custom_call_targets,
    is_async_fusion_copy,
)
from hlo_tools.module import Computation, HloModule, Instruction

_PAIRED = KINDS + ("send", "recv")
# Ops that only name, move or wrap values: never compute, whatever runs between.
_TRIVIAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
# Custom-calls that allocate or mark rather than compute.
_TRIVIAL_TARGETS = {"AllocateBuffer", TPU_START, TPU_DONE}
# Opcodes that compute (besides fusions and custom-calls, judged by what they hold).
COMPUTE_OPCODES = frozenset(
    {
        "convolution",
        "dot",
        "ragged-dot",
        "while",
        "call",
        "conditional",
        "reduce",
        "reduce-window",
        "select-and-scatter",
        "scatter",
        "gather",
        "sort",
        "fft",
        "triangular-solve",
        "cholesky",
    }
)
# Ops that carry an async collective's state from its start to its done.
_CARRIERS = {"get-tuple-element", "tuple", "bitcast", "copy", "async-update"}


@dataclass(frozen=True)
class AsyncPair:
    """One asynchronous collective as scheduled: ``start`` and ``done`` in ``computation``.

    ``done`` is None when no done for the start is in the same computation
    (passed out of a loop body or a call); ``between`` then runs to the end of
    the computation. ``between`` names the compute instructions scheduled
    after the start and before the done, in schedule order.
    """

    computation: str
    start: str
    done: str | None
    between: tuple[str, ...]


def tpu_fusion_role(module: HloModule, instr: Instruction) -> str | None:
    """``"start"``, ``"done"`` or ``"continuation"`` for TPU async collective fusions; else None.

    A continuation fusion repeats the collective (its ``backend_config`` has
    ``async_collective_fusion_config``) beside compute scheduled under it.
    """
    if instr.opcode != "fusion":
        return None
    called = instr.attributes.get("calls", "").lstrip("%")
    targets = custom_call_targets(module, called)
    if TPU_START in targets:
        return "start"
    if TPU_DONE in targets:
        return "done"
    comp = module.computations.get(called)
    if comp and any(is_async_fusion_copy(module, i) for i in comp.instructions):
        return "continuation"
    return None


def is_start(module: HloModule, instr: Instruction) -> bool:
    """Whether the instruction issues an asynchronous collective (any of the three spellings)."""
    op = instr.opcode
    if op in ("async-start", "send", "recv"):
        return True
    if op.endswith("-start") and op.removesuffix("-start") in _PAIRED:
        return True
    return tpu_fusion_role(module, instr) == "start"


def is_done(module: HloModule, instr: Instruction) -> bool:
    """Whether the instruction waits for an asynchronous collective."""
    op = instr.opcode
    if op == "async-done":
        return True
    if op.endswith("-done") and op.removesuffix("-done") in _PAIRED:
        return True
    return tpu_fusion_role(module, instr) == "done"


def does_compute(module: HloModule, instr: Instruction) -> bool:
    """Whether an instruction is work an async collective can hide behind.

    Fusions count when their computation holds anything but parameters,
    constants, tuples, bitcasts and collectives (a collective fusion is a
    collective; a TPU continuation counts for the compute beside its repeat);
    custom-calls count except buffer allocations and async markers; so do
    convolutions, dots, loops, calls and the other ``COMPUTE_OPCODES``. Starts
    and dones of collectives and copies are never compute.
    """
    op = instr.opcode
    if op in COMPUTE_OPCODES:
        return True
    if op == "custom-call":
        return custom_call_target(instr) not in _TRIVIAL_TARGETS
    if op != "fusion" or tpu_fusion_role(module, instr) in ("start", "done"):
        return False
    return _holds_compute(module, instr.attributes.get("calls", "").lstrip("%"), 0)


def _holds_compute(module: HloModule, computation: str, depth: int) -> bool:
    comp = module.computations.get(computation)
    if comp is None or depth > 16:
        return False
    for i in comp.instructions:
        if i.opcode in _TRIVIAL or i.opcode in KINDS:
            continue
        if i.opcode == "custom-call" and custom_call_target(i) in _TRIVIAL_TARGETS:
            continue
        if i.opcode == "fusion":
            if _holds_compute(module, i.attributes.get("calls", "").lstrip("%"), depth + 1):
                return True
            continue
        return True
    return False


def async_pairs(module: HloModule) -> dict[tuple[str, str], AsyncPair]:
    """Every asynchronous start in the module, keyed ``(computation, start name)``, with its done.

    A done is matched to the start it reaches through its operands, following
    only what carries the async state: tuple elements, bitcasts, copies,
    ``async-update`` and TPU continuation fusions.
    """
    out = {}
    for comp in module.computations.values():
        order = {i.name: k for k, i in enumerate(comp.instructions)}
        dones = {}
        for instr in comp.instructions:
            if is_done(module, instr):
                start = _start_of(module, comp, instr)
                if start is not None and start not in dones:
                    dones[start] = instr.name
        for instr in comp.instructions:
            if not is_start(module, instr):
                continue
            done = dones.get(instr.name)
            end = order[done] if done else len(comp.instructions)
            between = tuple(
                i.name
                for i in comp.instructions[order[instr.name] + 1 : end]
                if does_compute(module, i)
            )
            out[(comp.name, instr.name)] = AsyncPair(comp.name, instr.name, done, between)
    return out


def _start_of(module: HloModule, comp: Computation, done: Instruction) -> str | None:
    """The start a done waits for: breadth first back through the carriers."""
    queue, seen = deque(done.operands), set()
    while queue:
        name = queue.popleft()
        if name in seen or name not in comp.by_name:
            continue
        seen.add(name)
        instr = comp.by_name[name]
        if is_start(module, instr):
            return name
        if instr.opcode in _CARRIERS or tpu_fusion_role(module, instr) == "continuation":
            queue.extend(instr.operands)
    return None
