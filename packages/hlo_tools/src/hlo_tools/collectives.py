"""Collective records: what each collective moves, among whom, and how often per step."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hlo_tools.callgraph import Context, Loop, call_graph
from hlo_tools.module import HloModule, Instruction
from hlo_tools.parser import parse
from hlo_tools.shapes import ArrayType, TupleType, leaf_arrays

KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# Kinds that sum across devices: the ones a gradient reduction compiles to.
REDUCTION_KINDS = ("all-reduce", "reduce-scatter")

# TPU async collective fusions: the custom-calls that end the start and done fusions.
TPU_START, TPU_DONE = "AsyncCollectiveStart", "AsyncCollectiveDone"

# A multi-slice TPU program is one slice's program: its collectives across slices
# are host-transfer sends to the megascale (DCN) runtime, tagged with their kind.
_MEGASCALE_KIND = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


def megascale_kind(instr: Instruction) -> str | None:
    """The collective kind of a megascale (cross-slice, DCN) send; None otherwise.

    The matching recv is the other half of the same transfer and is not counted.
    """
    if instr.opcode not in ("send", "send-start"):
        return None
    m = _MEGASCALE_KIND.search(instr.attributes.get("frontend_attributes", ""))
    return m.group(1).lower().replace("_", "-") if m else None


def custom_call_target(instr: Instruction) -> str:
    """A custom-call's ``custom_call_target`` without quotes ('' for other ops)."""
    return instr.attributes.get("custom_call_target", "").strip('"')


def custom_call_targets(module: HloModule, computation: str) -> set[str]:
    """``custom_call_target`` of every custom-call in a computation."""
    comp = module.computations.get(computation)
    if comp is None:
        return set()
    return {custom_call_target(i) for i in comp.instructions if i.opcode == "custom-call"}


def is_async_fusion_copy(module: HloModule, instr: Instruction) -> bool:
    """Whether a collective is a TPU async collective fusion's repeat of it in a
    continuation or done fusion; only the start fusion's copy is the collective."""
    if instr.opcode not in KINDS:
        return False
    if "async_collective_fusion_config" not in instr.attributes.get("backend_config", ""):
        return False
    return TPU_START not in custom_call_targets(module, instr.computation)


def collective_kind(opcode: str) -> str | None:
    """The collective kind of an opcode (``all-reduce-start`` -> ``all-reduce``); None otherwise.

    ``-done`` forms return None: a start/done pair is one collective.
    """
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


@dataclass(frozen=True)
class Collective:
    """One collective in one calling context.

    ``arrays`` are the payload arrays: the result, except for ``-start`` forms
    whose tuple results also hold the operands (all-gather-start,
    all-to-all-start, collective-permute-start) or sync flags; there the output half is kept.
    ``bytes`` and ``elements`` sum over ``arrays``. ``multiplier`` is the product
    of the enclosing loops' trip counts, None when any is unknown.
    """

    kind: str
    opcode: str
    name: str
    computation: str
    arrays: tuple[ArrayType, ...]
    replica_groups: tuple[tuple[int, ...], ...] | None
    group_size: int | None
    loops: tuple[Loop, ...]
    via: tuple[str, ...]
    conditional: bool
    op_name: str
    channel_id: int | None
    line_number: int
    cross_slice: bool = False  # a megascale (DCN) transfer between slices

    @property
    def dtype(self) -> str:
        """Element type, comma-joined when the payload mixes types."""
        return ",".join(dict.fromkeys(a.dtype for a in self.arrays))

    @property
    def shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        """Dimensions of the payload; a tuple of them when there are several arrays."""
        if len(self.arrays) == 1:
            return self.arrays[0].dims
        return tuple(a.dims for a in self.arrays)

    @property
    def type_str(self) -> str:
        """``f32[3,4,4]`` or ``(f32[4], bf16[8])``."""
        if len(self.arrays) == 1:
            return str(self.arrays[0])
        return "(" + ", ".join(map(str, self.arrays)) + ")"

    @property
    def elements(self) -> int:
        """Elements moved per execution."""
        return sum(a.elements for a in self.arrays)

    @property
    def bytes(self) -> int:
        """Bytes per execution (unpadded)."""
        return sum(a.bytes for a in self.arrays)

    @property
    def in_loop(self) -> bool:
        """Whether any while loop encloses this collective."""
        return bool(self.loops)

    @property
    def multiplier(self) -> int | None:
        """Executions per step: the product of trip counts, None when one is unknown."""
        return Context(self.loops, self.via, self.conditional).multiplier

    @property
    def bytes_per_step(self) -> int | None:
        """``bytes * multiplier``; None when the multiplier is unknown."""
        m = self.multiplier
        return None if m is None else self.bytes * m

    @property
    def loop_path(self) -> str:
        """Loops outermost first, e.g. ``%while.87(x2) > %while.89(x3)``; ``-`` outside loops."""
        return " > ".join(map(str, self.loops)) or "-"

    @property
    def cross_replica(self) -> bool:
        """False only when every group is a single device (a no-op collective)."""
        return self.group_size is None or self.group_size > 1


def collectives(module: HloModule | str) -> list[Collective]:
    """Every collective reachable from ENTRY, once per calling context.

    Accepts a parsed module or HLO text. Records come in text order of their
    instructions. A collective inside a fusion, a called computation, an async
    wrapper or a conditional branch is found through the call graph; each
    branch of a conditional is counted (an upper bound; see ``conditional``).
    A TPU async collective fusion repeats its collective in each continuation
    and in its done; only the start's copy is counted.

    >>> [(c.name, c.kind, c.bytes, c.group_size, c.in_loop, c.multiplier)
    ...  for c in ht.collectives(HLO)]
    [('r', 'all-reduce', 1024, 4, True, 4), ('out', 'all-reduce', 1024, 4, False, 1)]
    """
    module = _as_module(module)
    graph = call_graph(module)
    out = []
    for comp in module.computations.values():
        contexts = graph.contexts.get(comp.name)
        if not contexts:
            continue
        for instr in comp.instructions:
            kind = collective_kind(instr.opcode)
            dcn_kind = megascale_kind(instr)
            if (kind is None and dcn_kind is None) or is_async_fusion_copy(module, instr):
                continue
            if dcn_kind is not None:
                # Payload: the value sent (first tuple element); no replica groups.
                kind, groups, size = dcn_kind, None, None
                arrays = tuple(leaf_arrays(instr.type.elements[0]))
            else:
                arrays = tuple(_payload(instr))
                groups = instr.replica_groups
                size = _group_size(module, instr, groups)
            for ctx in contexts:
                out.append(
                    Collective(
                        kind=kind,
                        opcode=instr.opcode,
                        name=instr.name,
                        computation=comp.name,
                        arrays=arrays,
                        replica_groups=groups,
                        group_size=size,
                        loops=ctx.loops,
                        via=ctx.via,
                        conditional=ctx.conditional,
                        op_name=instr.op_name or ctx.op_name,
                        channel_id=instr.channel_id,
                        line_number=instr.line_number,
                        cross_slice=dcn_kind is not None,
                    )
                )
    return out


def _as_module(module: HloModule | str) -> HloModule:
    if isinstance(module, str):
        return parse(module)
    return module


def _payload(instr: Instruction) -> list[ArrayType]:
    t = instr.type
    if not instr.opcode.endswith("-start") or not isinstance(t, TupleType):
        return leaf_arrays(t)
    # -start results: (operands, outputs[, context scalars]). Take the outputs.
    parts = t.elements
    if instr.opcode.startswith("collective-permute") and len(parts) >= 2:
        return leaf_arrays(parts[1])
    # GPU's all-to-all-start: ((operands...), output).
    if instr.opcode.startswith(("all-gather", "all-to-all")) and len(parts) == 2:
        return leaf_arrays(parts[1])
    return leaf_arrays(t)


def _group_size(module: HloModule, instr: Instruction, groups) -> int | None:
    if "replica_groups" not in instr.attributes:
        # collective-permute uses source_target_pairs; there is no group to speak of.
        return None if instr.opcode.startswith("collective-permute") else module.num_devices
    if groups is None:
        return module.num_devices
    sizes = {len(g) for g in groups}
    return sizes.pop() if len(sizes) == 1 else max(sizes)
