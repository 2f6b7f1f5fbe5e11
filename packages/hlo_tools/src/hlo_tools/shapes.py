"""HLO result types: arrays like ``bf16[8,128]{1,0:T(8,128)(2,1)S(1)}`` and tuples of them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hlo_tools.errors import HloParseError
from hlo_tools.text import match_bracket, skip_comment

# Bits per element. Sub-byte types are packed, so bytes round up per array.
_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}
_FLOAT8_OR_SMALLER = re.compile(r"f(8|6|4)e\d+m\d+\w*")
_DTYPE = re.compile(r"[a-z][a-z0-9_]*")
_DIM = re.compile(r"(<=)?(\d+|\?)$")


def dtype_bits(dtype: str) -> int | None:
    """Bits per element of an HLO element type, or None when the type is unknown."""
    if dtype in _BITS:
        return _BITS[dtype]
    m = _FLOAT8_OR_SMALLER.fullmatch(dtype)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ArrayType:
    """One array: element type, dimensions (bounded dynamic dims use their bound), layout text."""

    dtype: str
    dims: tuple[int, ...]
    layout: str = ""

    @property
    def elements(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        """Unpadded size in bytes (tiling padding from TPU layouts is not counted)."""
        bits = dtype_bits(self.dtype) or 0
        return (self.elements * bits + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class TupleType:
    """A tuple of types, possibly nested."""

    elements: tuple[ArrayType | TupleType, ...]

    def arrays(self) -> list[ArrayType]:
        """All leaf arrays, depth first."""
        out: list[ArrayType] = []
        for e in self.elements:
            out.extend(e.arrays() if isinstance(e, TupleType) else [e])
        return out

    def __str__(self) -> str:
        return "(" + ", ".join(map(str, self.elements)) + ")"


HloType = ArrayType | TupleType


def leaf_arrays(t: HloType) -> list[ArrayType]:
    """The arrays of a type: itself for an array, the leaves for a tuple."""
    return t.arrays() if isinstance(t, TupleType) else [t]


def parse_type(s: str, i: int = 0, line_number: int = 0) -> tuple[HloType, int]:
    """Parse a type starting at ``s[i]``; return it and the index just past it."""
    i = _skip_space(s, i, line_number)
    if i < len(s) and s[i] == "(":
        elements = []
        i += 1
        while True:
            i = _skip_space(s, i, line_number)
            if i < len(s) and s[i] == ")":
                return TupleType(tuple(elements)), i + 1
            t, i = parse_type(s, i, line_number)
            elements.append(t)
            i = _skip_space(s, i, line_number)
            if i < len(s) and s[i] == ",":
                i += 1
            elif i >= len(s) or s[i] != ")":
                raise HloParseError(f"bad tuple type at column {i + 1}", line_number, s)
    m = _DTYPE.match(s, i)
    if not m:
        raise HloParseError(f"expected a type at column {i + 1}", line_number, s)
    dtype = m.group(0)
    if dtype_bits(dtype) is None:
        raise HloParseError(f"unknown element type {dtype!r}", line_number, s)
    i = m.end()
    if i >= len(s) or s[i] != "[":
        raise HloParseError(f"expected '[' after element type {dtype!r}", line_number, s)
    end = match_bracket(s, i, line_number)
    dims = []
    for d in s[i + 1 : end - 1].split(","):
        d = d.strip()
        if not d:
            continue
        dm = _DIM.match(d)
        if not dm:
            raise HloParseError(f"bad dimension {d!r}", line_number, s)
        # Unbounded dynamic dims ('?') have no size to count; treat them as 0 elements.
        dims.append(0 if dm.group(2) == "?" else int(dm.group(2)))
    i = end
    layout = ""
    if i < len(s) and s[i] == "{":
        end = match_bracket(s, i, line_number)
        layout = s[i + 1 : end - 1]
        i = end
    return ArrayType(dtype, tuple(dims), layout), i


def _skip_space(s: str, i: int, line_number: int) -> int:
    while i < len(s):
        if s[i] in " \t":
            i += 1
        elif s.startswith("/*", i):
            i = skip_comment(s, i, line_number)
        else:
            break
    return i
