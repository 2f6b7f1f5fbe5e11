"""Where a value goes: forward dataflow through a compiled HLO module.

A gradient's reduction and an activation cotangent's can have the same shape,
the same replica groups and the same loop; what tells them apart is where the
reduced value goes. A gradient is only moved, converted, scaled and summed into
an accumulator carried by the microbatch loop; an activation cotangent feeds
further backward compute (the dots of the weight and input gradients, a norm's
sums). `reaches_root` follows a value from instruction to user, into and out of
fusions, calls, conditionals and while loops (tuple elements tracked by index),
and stops at the operations that mix it with other data by contraction.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterator

from hlo_tools.collectives import KINDS
from hlo_tools.module import HloModule, Instruction
from hlo_tools.shapes import TupleType

# Operations whose result mixes the value with other data by contraction or a
# sum over its own elements: past them, the value is an input of compute (an
# activation cotangent feeding a weight's gradient, a norm's backward sums),
# not a value carried on. A gradient is never contracted or summed over its own
# elements between its reduction and its accumulator.
CONTRACTING_OPCODES = frozenset(
    {
        "dot",
        "convolution",
        "ragged-dot",
        "reduce",
        "reduce-window",
        "select-and-scatter",
        "fft",
        "triangular-solve",
        "cholesky",
    }
)
# Custom calls that are matmuls by another name (CPU's oneDNN, GPU's cuBLAS).
_CONTRACTING_TARGETS = ("matmul", "conv", "gemm", "dot")
# Instructions that pass operands into a called computation's parameters, and the
# attribute naming it. Reducers (`to_apply` of reduce, all-reduce, scatter...) do
# not receive the operand arrays, only their elements pairwise: not followed.
_CALLS_WITH_OPERANDS = {"fusion": "calls", "call": "to_apply", "async-start": "calls"}

Value = tuple[str, str, int | None]  # (computation, instruction, tuple index or None: whole)


def contracts(instr: Instruction) -> bool:
    """Whether `instr` contracts or sums over its operands (see CONTRACTING_OPCODES)."""
    if instr.opcode in CONTRACTING_OPCODES:
        return True
    if instr.opcode == "custom-call":
        target = instr.attributes.get("custom_call_target", "").lower()
        return any(word in target for word in _CONTRACTING_TARGETS)
    return False


def users(module: HloModule) -> dict[tuple[str, str], list[tuple[Instruction, int]]]:
    """(computation, instruction) -> [(user, operand position)], built once per module."""
    return module.derived("users", _users)


def _users(module: HloModule) -> dict[tuple[str, str], list[tuple[Instruction, int]]]:
    table: dict[tuple[str, str], list[tuple[Instruction, int]]] = {}
    for comp in module.computations.values():
        for instr in comp.instructions:
            for position, operand in enumerate(instr.operands):
                table.setdefault((comp.name, operand), []).append((instr, position))
    return table


def callers(module: HloModule) -> dict[str, list[Instruction]]:
    """computation -> the instructions that pass it operands (fusion, call,
    async-start, while body, conditional branch), built once per module."""
    return module.derived("callers", _callers)


def _callers(module: HloModule) -> dict[str, list[Instruction]]:
    table: dict[str, list[Instruction]] = {}
    for instr in module.instructions():
        for attr, callee in instr.called():
            if _passes_operands(instr, attr):
                table.setdefault(callee, []).append(instr)
    return table


def _passes_operands(instr: Instruction, attr: str) -> bool:
    if instr.opcode == "while":
        return attr == "body"
    if instr.opcode == "conditional":
        return attr in ("branch_computations", "true_computation", "false_computation")
    return _CALLS_WITH_OPERANDS.get(instr.opcode) == attr


def _combined(instr: Instruction) -> bool:
    """A collective of several operands (XLA's combiner merges them): operand k
    becomes element k of its tuple result."""
    return (
        instr.opcode.removesuffix("-start") in KINDS
        and tuple_elements(instr) == len(instr.operands) > 1
    )


def _parameter(module: HloModule, computation: str, number: int) -> Instruction | None:
    for instr in module.computations[computation].instructions:
        if instr.opcode == "parameter" and instr.literal.strip() == str(number):
            return instr
    return None


def _into_callee(module: HloModule, user: Instruction, position: int, index) -> Iterator[Value]:
    """The parameters of `user`'s called computations that operand `position` becomes."""
    if user.opcode == "while":
        targets = [(user.attributes["body"].lstrip("%"), 0)]
    elif user.opcode == "conditional":
        branches = [c for attr, c in user.called() if _passes_operands(user, attr)]
        if position == 0 or position > len(branches):
            return  # the predicate / branch index
        targets = [(branches[position - 1], 0)]
    else:
        targets = [(c, position) for attr, c in user.called() if _passes_operands(user, attr)]
    for computation, number in targets:
        param = _parameter(module, computation, number)
        if param is not None:
            yield (computation, param.name, index)


def _out_of_root(module: HloModule, computation: str, index) -> Iterator[Value]:
    """Where a value reaching `computation`'s ROOT goes: each caller's result (and,
    for a while body, the next iteration's parameter)."""
    for caller in callers(module).get(computation, []):
        whole = None if caller.opcode in ("async-start", "conditional") else index
        yield (caller.computation, caller.name, whole)
        if caller.opcode == "while":
            param = _parameter(module, computation, 0)
            if param is not None:
                yield (computation, param.name, index)


def _successors(module: HloModule, value: Value) -> Iterator[Value]:
    computation, name, index = value
    comp = module.computations[computation]
    if comp.by_name[name].is_root:
        yield from _out_of_root(module, computation, index)
    for user, position in users(module).get((computation, name), []):
        if contracts(user):
            continue  # an input of compute, not a value carried on
        if user.opcode == "get-tuple-element":
            if index is None or str(index) == user.attributes.get("index"):
                yield (computation, user.name, None)
        elif user.opcode == "tuple" or _combined(user):
            yield (computation, user.name, position)
        elif user.opcode in ("while", "conditional") or user.opcode in _CALLS_WITH_OPERANDS:
            yield from _into_callee(module, user, position, index)
            if user.opcode == "async-start":
                yield (computation, user.name, None)
        else:
            # Elementwise, layout and data movement, collectives, -done forms:
            # the result carries the value (whole: tuple indices do not survive).
            keep = index if user.opcode.endswith("-done") else None
            yield (computation, user.name, keep)


def _flow(module: HloModule, start: Value, stop: Callable[[Value], bool]) -> Iterator[Value]:
    """The values `start` flows to (`start` first), breadth first, not past one
    that `stop` accepts (it is yielded, its users are not followed)."""
    seen, queue = {start}, deque([start])
    while queue:
        value = queue.popleft()
        yield value
        if value != start and stop(value):
            continue
        for nxt in _successors(module, value):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)


def reaches_root(
    module: HloModule, computation: str, name: str, *, target: str, index: int | None = None
) -> bool:
    """Whether instruction `name` of `computation` (element `index` of its tuple
    result, or all of it) flows to the ROOT of computation `target` without
    passing an operation that contracts it (`contracts`). `target` is a while
    body (the loop's carry) or the ENTRY computation (the program's output).

    Example (the setup in `help(hlo_tools)`): the loop carries the all-reduced
    `%r`, and the program outputs the loop's result after one more all-reduce:

    >>> module = ht.parse(HLO)
    >>> ht.reaches_root(module, "body", "r", target="body")
    True
    >>> ht.reaches_root(module, "body", "r", target="main")
    True
    >>> ht.reaches_root(module, "body", "i", target="main")  # the counter: not output
    False
    """
    return any(
        value[0] == target and module.computations[target].by_name[value[1]].is_root
        for value in _flow(module, (computation, name, index), stop=lambda value: False)
    )


def first_marked(
    module: HloModule,
    computation: str,
    name: str,
    *,
    pattern: str | re.Pattern,
    index: int | None = None,
) -> set[str]:
    r"""Group 1 of `pattern` (or the whole match) in the op_name of the first
    instructions, following the value forward as `reaches_root` does, whose
    op_name matches: where the value arrives in code the program marked with a
    named scope (e.g. the addition into one parameter's accumulator), not past
    it. Instructions inside fusions keep their own op_names, so a fusion of
    several marked additions is told apart by the one the value enters.

    Example (the setup in `help(hlo_tools)`): nothing in it is marked:

    >>> ht.first_marked(ht.parse(HLO), "body", "r", pattern=r"acc\[(\d+)\]")
    set()
    """
    regex = re.compile(pattern)
    start = (computation, name, index)

    def match(value: Value) -> re.Match | None:
        op_name = module.computations[value[0]].by_name[value[1]].op_name
        return regex.search(op_name)

    found = set()
    for value in _flow(module, start, stop=lambda value: match(value) is not None):
        hit = None if value == start else match(value)
        if hit is not None:
            found.add(hit.group(1) if regex.groups else hit.group(0))
    return found


def tuple_elements(instr: Instruction) -> int:
    """How many elements a tuple-typed result has (0 for an array)."""
    return len(instr.type.elements) if isinstance(instr.type, TupleType) else 0
