"""Which mesh axes a collective's replica groups run across.

Replica groups hold logical device ids: positions in the mesh's row-major
device order (how JAX hands a `Mesh` to XLA). A device's coordinate along an
axis follows from that position and the mesh shape, so "does this all-reduce
sum over 'data'?" is a question about the groups alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from hlo_tools.collectives import Collective


def axis_index(device: int, mesh_shape: Mapping[str, int], axis: str) -> int:
    """The coordinate along `axis` of logical device `device` in a row-major mesh."""
    if axis not in mesh_shape:
        raise KeyError(f"mesh axis {axis!r} is not one of {list(mesh_shape)}")
    names = list(mesh_shape)
    stride = math.prod(mesh_shape[a] for a in names[names.index(axis) + 1 :])
    return (device // stride) % mesh_shape[axis]


def spans_mesh_axis(collective: Collective, mesh_shape: Mapping[str, int], axis: str) -> bool:
    """Whether some replica group joins devices at different coordinates along `axis`.

    `mesh_shape` is the mesh's ordered axis -> size mapping (`dict(mesh.shape)`).
    No replica groups means one group of every device: it spans every axis of
    size above one.
    """
    devices = math.prod(mesh_shape.values())
    groups = collective.replica_groups or (tuple(range(devices)),)
    return any(len({axis_index(d, mesh_shape, axis) for d in group}) > 1 for group in groups)


def spanned_axes(records, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) that some record's replica groups span."""
    return tuple(a for a in mesh_shape if any(spans_mesh_axis(c, mesh_shape, a) for c in records))
