"""The parsed form of an HLO module: computations of instructions."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from hlo_tools.replica_groups import Groups, parse_replica_groups
from hlo_tools.shapes import HloType

# Attributes whose value names other computations, and what calling through them means.
COMPUTATION_ATTRIBUTES = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
)

_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')

T = TypeVar("T")


@dataclass
class Instruction:
    """One HLO instruction line.

    ``attributes`` maps each ``key=value`` after the operands to its raw value text.
    ``operands`` are the names (without ``%``) of the operand instructions; for
    ``constant`` and ``parameter`` the parenthesised text is kept in ``literal``.
    """

    name: str
    type: HloType
    opcode: str
    operands: tuple[str, ...]
    attributes: dict[str, str]
    computation: str
    line_number: int
    line: str
    is_root: bool = False
    literal: str = ""

    def called(self) -> list[tuple[str, str]]:
        """``(attribute, computation name)`` for every computation this instruction names."""
        out = []
        for key in COMPUTATION_ATTRIBUTES:
            if key in self.attributes:
                for name in computation_list(self.attributes[key]):
                    out.append((key, name))
        return out

    @property
    def op_name(self) -> str:
        """``metadata={op_name=...}``, the JAX source path of the op; '' when absent."""
        m = _OP_NAME.search(self.attributes.get("metadata", ""))
        return m.group(1).replace('\\"', '"') if m else ""

    @cached_property
    def replica_groups(self) -> Groups | None:
        """Parsed ``replica_groups``; None for ``{}`` (every device) or when absent."""
        value = self.attributes.get("replica_groups")
        if value is None:
            return None
        return parse_replica_groups(value, self.line_number, self.attributes.get("device_ids"))

    @property
    def channel_id(self) -> int | None:
        """``channel_id=`` as an int, None when absent."""
        value = self.attributes.get("channel_id")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def known_trip_count(self) -> int | None:
        """``backend_config`` ``known_trip_count.n`` of a while loop, None when absent."""
        config = self.attributes.get("backend_config", "")
        if "known_trip_count" not in config:
            return None
        try:
            n = json.loads(config)["known_trip_count"]["n"]
            return int(n)
        except (ValueError, KeyError, TypeError):
            # Not plain JSON (older printers quote it); fall back to a pattern.
            m = _TRIP_COUNT.search(config)
            return int(m.group(1)) if m else None


def computation_list(value: str) -> list[str]:
    """``%a`` or ``{%a, %b}`` -> ``['a', 'b']``."""
    v = value.strip()
    if v.startswith("{") and v.endswith("}"):
        v = v[1:-1]
    return [p.strip().lstrip("%") for p in v.split(",") if p.strip()]


@dataclass
class Computation:
    """A named computation; ``instructions`` in text order."""

    name: str
    is_entry: bool
    line_number: int
    instructions: list[Instruction] = field(default_factory=list)

    @cached_property
    def by_name(self) -> dict[str, Instruction]:
        """Instructions keyed by name."""
        return {i.name: i for i in self.instructions}

    @property
    def root(self) -> Instruction:
        """The ROOT instruction."""
        return next(i for i in self.instructions if i.is_root)


@dataclass
class HloModule:
    """A parsed module. ``attributes`` are the ``HloModule`` header's ``key=value`` pairs."""

    name: str
    attributes: dict[str, str]
    computations: dict[str, Computation]
    entry_name: str
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def entry(self) -> Computation:
        """The ENTRY computation."""
        return self.computations[self.entry_name]

    @property
    def num_devices(self) -> int:
        """replica_count x num_partitions from the header (1 each when absent)."""
        replicas = self.attributes.get("replica_count", "1")
        partitions = self.attributes.get("num_partitions", "1")
        return int(replicas) * int(partitions) if (replicas + partitions).isdigit() else 1

    def instructions(self):
        """Every instruction of every computation, in text order."""
        for comp in self.computations.values():
            yield from comp.instructions

    def derived(self, key: str, build: Callable[[HloModule], T]) -> T:
        """`build(self)`, built on first use and kept with the module.

        The analyses of a parsed module (hlo_tools.callgraph's `call_graph`,
        hlo_tools.dataflow's `users` and `callers`) are functions of it in the
        modules above this one; each is built once per module through here.
        """
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]
