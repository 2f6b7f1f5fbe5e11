"""Call graph from ENTRY: which while loops enclose each computation, and how often they run.

Edges follow every attribute that names a computation (while body/condition,
conditional branches, call, fusion ``calls=``, reducers, async ``-start``
wrappers). Only while body/condition edges add a loop. Async ``-update``/``-done``
wrappers name the same computation as their ``-start``; following them too would
count the wrapped collective twice, so they are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hlo_tools.errors import HloParseError
from hlo_tools.module import Computation, HloModule, Instruction

_LOOP_EDGES = {"body", "condition"}
_INT = re.compile(r"-?\d+$")


@dataclass(frozen=True)
class Loop:
    """A while loop. ``trip_count`` is None when unknown.

    ``trip_count_source`` is ``"known"`` (XLA's ``known_trip_count`` in
    backend_config), ``"inferred"`` (recognised ``i = k; i < n; i += 1`` pattern;
    TPU dumps omit ``known_trip_count``) or ``None``.
    """

    name: str
    computation: str
    trip_count: int | None
    trip_count_source: str | None
    op_name: str

    def __str__(self) -> str:
        trips = "?" if self.trip_count is None else str(self.trip_count)
        return f"%{self.name}(x{trips})"


@dataclass(frozen=True)
class Context:
    """One way a computation is reached from ENTRY.

    ``loops`` are the enclosing while loops, outermost first; ``via`` the names of
    the calling instructions along the path; ``conditional`` whether the path goes
    through a conditional branch (which may not run every time).
    """

    loops: tuple[Loop, ...]
    via: tuple[str, ...]
    conditional: bool
    # op_name of the innermost caller that has one: TPU's collective fusions carry
    # the JAX op_name on the fusion, not on the all-reduce inside.
    op_name: str = ""

    @property
    def multiplier(self) -> int | None:
        """Product of the loops' trip counts; None when any of them is unknown."""
        product = 1
        for loop in self.loops:
            if loop.trip_count is None:
                return None
            product *= loop.trip_count
        return product


class CallGraph:
    """Contexts of every computation reachable from ENTRY (``contexts[name]``)."""

    def __init__(self, module: HloModule):
        self.module = module
        self.contexts: dict[str, list[Context]] = {}
        self._loops: dict[tuple[str, str], Loop] = {}
        self._visit(module.entry, Context((), (), False), [])

    def _visit(self, comp: Computation, ctx: Context, stack: list[str]) -> None:
        if comp.name in stack:
            raise HloParseError(f"computation %{comp.name} calls itself", comp.line_number)
        self.contexts.setdefault(comp.name, []).append(ctx)
        stack.append(comp.name)
        for instr in comp.instructions:
            if instr.opcode.endswith(("-update", "-done")):
                continue
            for attr, callee in instr.called():
                loops = ctx.loops
                if attr in _LOOP_EDGES and instr.opcode == "while":
                    loops = loops + (self.loop(comp, instr),)
                child = Context(
                    loops,
                    ctx.via + (instr.name,),
                    ctx.conditional or instr.opcode == "conditional",
                    instr.op_name or ctx.op_name,
                )
                self._visit(self.module.computations[callee], child, stack)
        stack.pop()

    def loop(self, comp: Computation, instr: Instruction) -> Loop:
        """The :class:`Loop` for a while instruction (trip count known or inferred)."""
        key = (comp.name, instr.name)
        if key not in self._loops:
            trips, source = instr.known_trip_count, "known"
            if trips is None:
                trips = _infer_trip_count(self.module, comp, instr)
                source = "inferred" if trips is not None else None
            self._loops[key] = Loop(instr.name, comp.name, trips, source, instr.op_name)
        return self._loops[key]


def call_graph(module: HloModule) -> CallGraph:
    """The module's :class:`CallGraph`, built on first use and kept with the module.

    >>> graph = ht.call_graph(ht.parse(HLO))
    >>> [str(ctx.loops[0]) for ctx in graph.contexts["body"]]  # body runs in one loop
    ['%loop(x4)']
    """
    return module.derived("call_graph", CallGraph)


def _infer_trip_count(module: HloModule, comp: Computation, instr: Instruction) -> int | None:
    """Recognise a counted loop: tuple index i starts at constant k, the condition is
    ``i < n`` for a constant n and the body stores ``i + 1``. Anything else: None."""
    cond = module.computations.get(instr.attributes.get("condition", "").lstrip("%"))
    body = module.computations.get(instr.attributes.get("body", "").lstrip("%"))
    if cond is None or body is None or len(instr.operands) != 1:
        return None
    test = _expr(module, cond, cond.root, None, 0)
    if not test or test[0] != "compare":
        return None
    _, direction, lhs, rhs = test
    if direction == "GT":
        lhs, rhs, direction = rhs, lhs, "LT"
    if direction != "LT" or lhs[0] != "gte" or rhs[0] != "const":
        return None
    index, limit = lhs[1], rhs[1]
    init = comp.by_name.get(instr.operands[0])
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _expr(module, comp, comp.by_name[init.operands[index]], None, 0)
    root = body.root
    if not start or start[0] != "const" or root.opcode != "tuple" or index >= len(root.operands):
        return None
    step = _expr(module, body, body.by_name[root.operands[index]], None, 0)
    if step not in (("add", ("gte", index), ("const", 1)), ("add", ("const", 1), ("gte", index))):
        return None
    return max(0, limit - start[1])


def _expr(module: HloModule, comp: Computation, instr: Instruction, bindings, depth: int):
    """A tiny symbolic view of scalar integer code: const, gte(param, i), add, compare.

    ``bindings`` maps a fusion's parameter numbers to the expressions of the
    fusion's operands, so wrapped compares/adds (CPU) read like plain ones (TPU).
    """
    if depth > 32:
        return None
    op = instr.opcode

    def arg(k):
        if k >= len(instr.operands) or instr.operands[k] not in comp.by_name:
            return None
        return _expr(module, comp, comp.by_name[instr.operands[k]], bindings, depth + 1)

    if op in ("copy", "bitcast", "convert", "reshape"):
        return arg(0)
    if op == "constant":
        return ("const", int(instr.literal)) if _INT.match(instr.literal.strip()) else None
    if op == "parameter":
        if bindings is None:
            return ("param", instr.literal.strip())
        k = instr.literal.strip()
        return bindings[int(k)] if k.isdigit() and int(k) < len(bindings) else None
    if op == "get-tuple-element":
        base = arg(0)
        index = instr.attributes.get("index", "")
        if base and base[0] == "param" and index.isdigit():
            return ("gte", int(index))
        return None
    if op == "add":
        a, b = arg(0), arg(1)
        return ("add", a, b) if a and b else None
    if op == "compare":
        a, b = arg(0), arg(1)
        return ("compare", instr.attributes.get("direction"), a, b) if a and b else None
    if op == "fusion":
        inner = module.computations.get(instr.attributes.get("calls", "").lstrip("%"))
        if inner is None:
            return None
        args = tuple(arg(k) for k in range(len(instr.operands)))
        return _expr(module, inner, inner.root, args, depth + 1)
    return None
