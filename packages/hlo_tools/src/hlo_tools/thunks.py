"""Kernels an XLA:GPU program launches per step, from its thunk sequence.

XLA:GPU compiles a module to a sequence of thunks, which it writes with
``--xla_dump_to=DIR`` as ``*.thunk_sequence.txt``: one line per thunk
(``NNN: kKind [prev/next edges] name grid...``), the thunks of a while loop's
condition and body nested under its ``kWhile`` line. Counting each thunk that
launches work once per execution (the product of the trip counts of the loops
around it) gives the kernels per step, without a GPU: a compile-only topology
writes the same sequence, and the count is close to a profile of the real chip
(the profile's count: benchmarks/results/device_check.md; commit 16b31fe compares
the two on deepseek3-small).

The text's quirks this parser follows:

* a ``condition:`` line always starts at column 0, right after its ``kWhile``
  line; the condition's thunks and the ``body:`` line are indented deeper than
  the ``kWhile``, the body's thunks deeper than ``body:``; nested loops repeat it;
* ``kDynamicSliceFusion``, ``kAsyncStart`` (an asynchronous collective) and
  ``kCommandBuffer`` (after the thunk passes) wrap child thunks indented under
  them: the children launch, the wrapper does not (nor does ``kAsyncDone``, a wait);
* a ``kWhile`` line names nothing; ``*.thunk_metadata.txt`` maps its thunk id to
  its HLO instruction (``profile_annotation: "while.40"``), whose
  ``known_trip_count`` (or a recognised counted loop) gives the trips. The
  condition runs trips + 1 times, the body trips times;
* a ``kConditional`` (``lax.cond``, ``lax.switch``) holds its branches, each under
  a label line (``true_branch:``, ``false_branch:``, ...) indented deeper than it.
  One branch runs per execution, and which one is data: a count keeps the branch
  with the most launches (`pick_branches`; an upper bound).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hlo_tools.callgraph import call_graph
from hlo_tools.errors import HloParseError
from hlo_tools.module import HloModule

CATEGORIES = ("matmul", "copy/transpose", "elementwise/fusion", "collective", "other")
# Thunks that hold other thunks, or only wait/synchronise: they launch nothing.
WRAPPERS = {
    "kWhile",
    "kSequential",
    "kConditional",
    "kCommandBuffer",
    "kDynamicSliceFusion",
    "kAsyncStart",  # an async collective's start: the collective is its child line
}
_NO_LAUNCH = {"kWaitForStreams", "kGroupStart", "kGroupDone"}
_MATMUL_KINDS = {"kGemm", "kCublasLtMatmul", "kConvolution", "kCuDnn", "kNorm"}
_COLLECTIVES = (
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "AllToAll",
    "CollectivePermute",
    "CollectiveBroadcast",
    "Send",
    "Recv",
)
_COPY_KINDS = {"kCopy", "kMemset32BitValue", "kMemzero", "kDeviceToDevice"}
_KERNEL_KINDS = {"kKernel", "kCustomKernel"}

_LINE = re.compile(r"^( *)(\d+): (k\w+)\s*(?:\[[^\]]*\])?\s*(\S*)")
_REGION = re.compile(r"^( *)(condition|body):\s*$")
_BRANCH = re.compile(r"^( *)(\w[\w ]*):\s*$")
_META_ID = re.compile(r"thunk_id:\s*(\d+)")
_META_NAME = re.compile(r'profile_annotation:\s*"((?:[^"\\]|\\.)*)"')

OUTSIDE = "outside loops"


@dataclass
class KernelCount:
    """Kernels launched per step.

    ``by_category`` splits ``total`` over CATEGORIES; ``by_loop`` over where they
    run: ``"outside loops"`` or a loop path (``"while.40 x4 [jit(f)] > while.21 x3
    [jvp()]"``, outermost first; the brackets: ``loop_source``), each the kernels
    per step of the thunks directly in that loop (nested loops have their own
    entry). ``per_trip`` is the thunks of each loop path counted once (one trip).
    ``unknown_trips``: loops whose trip count was not found, counted as one trip;
    ``conditionals``: how many conditionals were counted by one branch (the one
    launching the most).
    """

    total: int = 0
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    by_loop: dict[str, int] = field(default_factory=dict)
    per_trip: dict[str, int] = field(default_factory=dict)
    unknown_trips: list[str] = field(default_factory=list)
    conditionals: int = 0


def category(kind: str, name: str) -> str | None:
    """The CATEGORIES entry of a thunk, None when it launches nothing.

    Kernels are told apart by the fusion names XLA gives them (``gemm_fusion_dot``,
    ``triton_gemm``, ``input_transpose_fusion``, ``loop_copy_fusion``)."""
    if kind in WRAPPERS or kind in _NO_LAUNCH or kind.endswith("Done"):
        return None
    if kind in _MATMUL_KINDS:
        return "matmul"
    if any(word in kind for word in _COLLECTIVES):
        return "collective"
    if kind in _COPY_KINDS:
        return "copy/transpose"
    if kind in _KERNEL_KINDS:
        lowered = name.lower()
        if "gemm" in lowered or "dot" in lowered or "matmul" in lowered:
            return "matmul"
        if "transpose" in lowered or "copy" in lowered:
            return "copy/transpose"
        return "elementwise/fusion"
    return "other"


def thunk_names(metadata_text: str) -> dict[int, str]:
    """thunk id -> its profile annotation (the HLO instruction), from thunk_metadata.txt."""
    names: dict[int, str] = {}
    for block in metadata_text.split("thunk_metadata {")[1:]:
        tid, name = _META_ID.search(block), _META_NAME.search(block)
        if tid and name:
            names[int(tid.group(1))] = name.group(1)
    return names


def trip_counts(module: HloModule) -> dict[str, int | None]:
    """while instruction name -> its trip count (known or inferred; None: unknown)."""
    graph = call_graph(module)
    out = {}
    for comp in module.computations.values():
        for instr in comp.instructions:
            if instr.opcode == "while":
                out[instr.name] = graph.loop(comp, instr).trip_count
    return out


def loop_source(op_name: str) -> str:
    """The innermost JAX transform or function of a while's op_name, to tell loops
    apart in a report: "jvp()" (a forward scan), "transpose(jvp())" (its backward),
    "vmap(jit(_searchsorted_scan_impl))", "accum_microbatch_loop" (a named scope,
    its bracketed details cut); "" when there is none."""
    parts = [p for p in op_name.split("/") if p not in ("while", "body", "closed_call", "cond")]
    return parts[-1].split("[")[0] if parts else ""


# Where a thunk sits among conditionals: (conditional's thunk id, branch label) pairs,
# outermost first; () outside every conditional.
Branch = tuple[tuple[int, str], ...]


@dataclass
class _Frame:
    indent: int  # of the wrapping thunk's line
    multiplier: int  # executions per step of the thunks inside
    loop: str  # the loop path the thunks inside belong to
    while_name: str = ""  # kWhile frames: the loop's label
    trips: int = 1
    outer: int = 1  # kWhile frames: the multiplier around the loop
    outer_loop: str = OUTSIDE
    conditional: int | None = None  # kConditional frames: its thunk id
    branch: Branch = ()  # the conditional branches the thunks inside are in


@dataclass(frozen=True)
class Launch:
    """One launching thunk of the sequence: its id, kind (``kKernel``, ``kGemm``,
    ...), the name on its line (a kernel's name; ``kCopy`` for a copy), the HLO
    instruction it runs (thunk metadata's profile annotation; "" when absent),
    its executions per step (the product of the trip counts around it, as if each
    conditional around it took its branch), the loop path it sits in (``OUTSIDE``
    or KernelCount.by_loop's keys) and its conditional branches (``Branch``)."""

    thunk_id: int
    kind: str
    name: str
    instruction: str
    executions: int
    loop: str
    category: str
    branch: Branch = ()


def launches(
    thunk_sequence_text: str,
    thunk_metadata_text: str,
    hlo_module: HloModule,
    unknown_trips: list[str] | None = None,
    arms: list[Branch] | None = None,
):
    """Yield a Launch per thunk that launches work, in sequence order (see the
    module docstring); the loops whose trip count was not found (counted as one
    trip) are appended to `unknown_trips` when given, and every conditional
    branch (a Branch, launching something or not) to `arms`."""
    names = thunk_names(thunk_metadata_text)
    trips = trip_counts(hlo_module)
    sources = {
        i.name: loop_source(i.op_name) for i in hlo_module.instructions() if i.opcode == "while"
    }
    stack: list[_Frame] = []

    def pop_to(indent: int) -> None:
        while stack and stack[-1].indent >= indent:
            stack.pop()

    for number, line in enumerate(thunk_sequence_text.splitlines(), 1):
        if not line.strip():
            continue
        region = _REGION.match(line)
        if region:
            if region.group(2) == "body":
                pop_to(len(region.group(1)))
            if not stack or not stack[-1].while_name:
                raise HloParseError(f"{region.group(2)}: outside a kWhile", number)
            top = stack[-1]
            runs = top.trips + 1 if region.group(2) == "condition" else top.trips
            top.multiplier = top.outer * runs
            top.loop = (
                top.while_name
                if top.outer_loop == OUTSIDE
                else f"{top.outer_loop} > {top.while_name}"
            )
            continue
        label = _BRANCH.match(line)
        if label:
            pop_to(len(label.group(1)))
            if not stack or stack[-1].conditional is None:
                raise HloParseError(f"{label.group(2)}: outside a kConditional", number)
            top = stack[-1]
            arm = (*top.branch, (top.conditional, label.group(2)))
            if arms is not None:
                arms.append(arm)
            stack.append(_Frame(len(label.group(1)), top.multiplier, top.loop, branch=arm))
            continue
        m = _LINE.match(line)
        if not m:
            raise HloParseError(f"not a thunk line: {line.strip()[:80]!r}", number)
        indent, tid, kind, name = len(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        pop_to(indent)
        multiplier = stack[-1].multiplier if stack else 1
        loop = stack[-1].loop if stack else OUTSIDE
        branch = stack[-1].branch if stack else ()
        if kind == "kWhile":
            hlo_name = names.get(tid, f"thunk {tid}")
            n = trips.get(hlo_name)
            if n is None:
                if unknown_trips is not None:
                    unknown_trips.append(hlo_name)
                n = 1
            label = f"{hlo_name} x{n}"
            if sources.get(hlo_name):
                label += f" [{sources[hlo_name]}]"
            # multiplier/loop are set by the condition:/body: lines that follow.
            stack.append(
                _Frame(indent, multiplier, loop, label, n, multiplier, loop, branch=branch)
            )
            continue
        if kind in WRAPPERS:
            conditional = tid if kind == "kConditional" else None
            stack.append(_Frame(indent, multiplier, loop, conditional=conditional, branch=branch))
            continue
        cat = category(kind, name)
        if cat is None:
            continue
        yield Launch(tid, kind, name, names.get(tid, ""), multiplier, loop, cat, branch)


def conditionals(branches: Sequence[Branch]) -> int:
    """How many conditionals the Branches `branches` lie in (thunk ids are unique)."""
    return len({thunk for path in branches for thunk, _ in path})


def pick_branches(
    branches: Sequence[Branch], weights: Sequence[float], pick: Callable = max
) -> list[bool]:
    """Which items to keep so that each conditional is counted by one branch: per
    conditional, the branch whose kept items weigh the most (`pick=min`: the least;
    ties: the first); `branches[i]` is item i's Branch, `weights[i]` its weight
    (launches, seconds). Inner conditionals are settled first, so an outer branch
    weighs its inner conditionals' picked branches only. A branch that launches
    nothing has no items: give it one of weight 0 (`launches`' `arms` lists them),
    or `pick=min` takes the lightest branch that launches something."""
    keep = [True] * len(branches)
    for depth in range(max(map(len, branches), default=0), 0, -1):
        totals: dict[Branch, float] = {}
        for i, path in enumerate(branches):
            if keep[i] and len(path) >= depth:
                totals[path[:depth]] = totals.get(path[:depth], 0.0) + weights[i]
        arms: dict[tuple[Branch, int], list[Branch]] = {}
        for arm in totals:
            arms.setdefault((arm[:-1], arm[-1][0]), []).append(arm)
        chosen = {key: pick(found, key=totals.__getitem__) for key, found in arms.items()}
        for i, path in enumerate(branches):
            if keep[i] and len(path) >= depth:
                keep[i] = chosen[(path[: depth - 1], path[depth - 1][0])] == path[:depth]
    return keep


def kernels_per_step(
    thunk_sequence_text: str, thunk_metadata_text: str, hlo_module: HloModule
) -> KernelCount:
    """Count the kernels a step launches (see the module docstring)."""
    count = KernelCount()
    found = list(
        launches(thunk_sequence_text, thunk_metadata_text, hlo_module, count.unknown_trips)
    )
    branches = [x.branch for x in found]
    kept = pick_branches(branches, [x.executions for x in found])
    count.conditionals = conditionals(branches)
    for launch in (x for x, keep in zip(found, kept, strict=True) if keep):
        count.total += launch.executions
        count.by_category[launch.category] += launch.executions
        count.by_loop[launch.loop] = count.by_loop.get(launch.loop, 0) + launch.executions
        count.per_trip[launch.loop] = count.per_trip.get(launch.loop, 0) + 1
    return count


def format_kernels(count: KernelCount) -> list[str]:
    """Report lines: the total, the mix by category, where they run."""
    total = max(count.total, 1)
    mix = ", ".join(
        f"{cat} {n:,} ({100 * n / total:.0f}%)" for cat, n in count.by_category.items() if n
    )
    lines = [
        f"kernels launched per step: {count.total:,} (XLA's thunk sequence x loop trip counts)",
        f"  mix: {mix}",
    ]
    for loop, n in count.by_loop.items():
        if loop == OUTSIDE:
            lines.append(f"  {loop}: {n:,}")
        else:
            lines.append(f"  {loop}: {count.per_trip[loop]:,} per trip, {n:,} per step")
    if count.conditionals:
        lines.append(
            f"  {count.conditionals:,} conditionals (lax.cond/switch), each counted by the "
            "branch launching the most: which one runs is data"
        )
    if count.unknown_trips:
        lines.append(f"  trip count unknown (counted once): {', '.join(count.unknown_trips)}")
    return lines
