"""Replica groups in the three printed forms.

- list:  ``{{0,1},{2,3}}`` (``{}`` means one group of every device)
- iota:  ``[2,4]<=[8]`` or ``[2,4]<=[4,2]T(1,0)``: iota over the bracketed
  shape, optionally transposed, reshaped to [num_groups, group_size]
- mesh:  ``mesh['axis_0'=8,'axis_1'=1] {'axis_0'}``: devices laid out in
  row-major order over the named mesh; one group per combination of the
  axes not listed, each group varying the listed axes. With a device order,
  XLA prints ``mesh[...], device_ids=([4,2]T(1,0)) {'axis_0'}``: the
  attribute splitter hands that to us as a separate ``device_ids`` value,
  whose iota (or explicit list) gives the device at each mesh position.
"""

from __future__ import annotations

import math
import re

from hlo_tools.errors import HloParseError

Groups = tuple[tuple[int, ...], ...]

_IOTA = re.compile(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_MESH = re.compile(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}$")
_MESH_AXIS = re.compile(r"'([^']*)'=(\d+)$")


_DEVICE_IDS = re.compile(r"\((.*)\)\s*(\{[^}]*\})$")


def parse_replica_groups(
    value: str, line_number: int = 0, device_ids: str | None = None
) -> Groups | None:
    """Parse a ``replica_groups=`` value. Returns None for ``{}`` (all devices).

    ``device_ids`` is the sibling attribute of a mesh form printed with a
    device order (``([4,2]T(1,0)) {'axis_0'}``).
    """
    v = value.strip()
    if v.startswith("mesh[") and device_ids is not None:
        m = _DEVICE_IDS.match(device_ids.strip())
        if not m:
            raise HloParseError(f"bad device_ids {device_ids!r}", line_number)
        groups = _parse_mesh(f"{v} {m.group(2)}", line_number)
        order = _device_order(m.group(1).strip(), line_number)
        if any(i >= len(order) for g in groups for i in g):
            raise HloParseError(f"device_ids {device_ids!r} shorter than the mesh", line_number)
        return tuple(tuple(order[i] for i in g) for g in groups)
    if v.startswith("{"):
        return _parse_list(v, line_number)
    if v.startswith("["):
        return _parse_iota(v, line_number)
    if v.startswith("mesh["):
        return _parse_mesh(v, line_number)
    raise HloParseError(f"unrecognised replica_groups {v!r}", line_number)


def _parse_list(v: str, line_number: int) -> Groups | None:
    if not v.endswith("}"):
        raise HloParseError(f"bad replica_groups {v!r}", line_number)
    inner = v[1:-1].strip()
    if not inner:
        return None
    groups = []
    for m in re.finditer(r"\{([^{}]*)\}|([^{},\s]+)", inner):
        if m.group(2) is not None:
            raise HloParseError(f"bad replica_groups {v!r}", line_number)
        ids = [x.strip() for x in m.group(1).split(",") if x.strip()]
        if not all(x.isdigit() for x in ids):
            raise HloParseError(f"bad replica_groups {v!r}", line_number)
        groups.append(tuple(int(x) for x in ids))
    if not groups:
        raise HloParseError(f"bad replica_groups {v!r}", line_number)
    return tuple(groups)


def _parse_iota(v: str, line_number: int) -> Groups:
    m = _IOTA.match(v.replace(" ", ""))
    if not m:
        raise HloParseError(f"bad iota replica_groups {v!r}", line_number)
    num_groups, group_size = int(m.group(1)), int(m.group(2))
    dims = [int(x) for x in m.group(3).split(",")]
    perm = [int(x) for x in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
    if sorted(perm) != list(range(len(dims))) or math.prod(dims) != num_groups * group_size:
        raise HloParseError(f"inconsistent iota replica_groups {v!r}", line_number)
    flat = _transposed_iota(dims, perm)
    return tuple(tuple(flat[g * group_size : (g + 1) * group_size]) for g in range(num_groups))


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """Row-major contents of ``iota(prod(dims)).reshape(dims).transpose(perm)``."""
    strides = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    out = []
    for flat in range(math.prod(out_dims)):
        # Unravel the output index, then map each output axis back to its source axis.
        rest, value = flat, 0
        for axis in reversed(range(len(out_dims))):
            rest, idx = divmod(rest, out_dims[axis])
            value += idx * strides[perm[axis]]
        out.append(value)
    return out


def _device_order(spec: str, line_number: int) -> list[int]:
    """Device at each mesh position: an iota ``[4,2]T(1,0)`` or a list ``0,2,4,...``."""
    compact = spec.replace(" ", "")
    m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?$", compact)
    if m:
        dims = [int(x) for x in m.group(1).split(",")]
        perm = [int(x) for x in m.group(2).split(",")] if m.group(2) else list(range(len(dims)))
        if sorted(perm) != list(range(len(dims))):
            raise HloParseError(f"bad device_ids iota {spec!r}", line_number)
        return _transposed_iota(dims, perm)
    if re.fullmatch(r"\d+(,\d+)*", compact):
        return [int(x) for x in compact.split(",")]
    raise HloParseError(f"bad device_ids {spec!r}", line_number)


def _parse_mesh(v: str, line_number: int) -> Groups:
    m = _MESH.match(v)
    if not m:
        raise HloParseError(f"bad mesh replica_groups {v!r}", line_number)
    names, sizes = [], []
    for part in m.group(1).split(","):
        am = _MESH_AXIS.match(part.strip())
        if not am:
            raise HloParseError(f"bad mesh axis {part!r}", line_number)
        names.append(am.group(1))
        sizes.append(int(am.group(2)))
    reduced = [x.strip().strip("'") for x in m.group(2).split(",") if x.strip()]
    if any(r not in names for r in reduced):
        raise HloParseError(f"mesh replica_groups name unknown axes {v!r}", line_number)
    # Put the kept axes first and the grouped axes last, then cut rows of group size.
    kept = [k for k, n in enumerate(names) if n not in reduced]
    grouped = [names.index(r) for r in reduced]
    flat = _transposed_iota(sizes, kept + grouped)
    group_size = math.prod(sizes[k] for k in grouped)
    return tuple(tuple(flat[g : g + group_size]) for g in range(0, len(flat), max(group_size, 1)))
