"""Slices: how many, which devices belong to each, and the mesh axes that cross them.

A multi-slice run joins several TPU slices over DCN. The trainer's mesh gives the
batch's cross-slice part its own outermost axes (config.DCN_AXES); the 'stage' and
'expert' axes (config.HYBRID_AXES) fold a cross-slice part in, major, so each slice
holds a contiguous range of their indices. On real slices the count comes from the devices'
`slice_index`; on CPU, `num_slices=N` emulates N slices as equal contiguous
blocks of the devices; an AOT compile takes `compile_topology_num_slices`.
Devices that report their slice are placed as MaxText places them
(`device_array`: the hybrid device mesh, each slice laid out by its ICI topology).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.experimental import mesh_utils

from trainer.config import DCN_AXES, MESH_AXES, STAGE_AXIS, ConfigError, ParallelismConfig


def detected_slices(devices: Sequence[Any]) -> int:
    """Distinct `slice_index` values among `devices` (1 when they carry none)."""
    indices = {getattr(d, "slice_index", None) for d in devices}
    indices.discard(None)
    return max(len(indices), 1)


def num_slices(parallelism: ParallelismConfig, devices: Sequence[Any]) -> int:
    """The slice count this run's mesh is built for; ConfigError naming the key
    when `num_slices` contradicts the topology or the slices the devices report."""
    if parallelism.compile_topology:
        wanted = parallelism.compile_topology_num_slices
        if parallelism.num_slices not in (-1, wanted):
            raise ConfigError(
                f"num_slices={parallelism.num_slices} contradicts "
                f"compile_topology_num_slices={wanted}"
            )
        return wanted
    found = detected_slices(devices)
    if parallelism.num_slices == -1:
        return found
    if parallelism.num_slices < 1:
        raise ConfigError(f"num_slices={parallelism.num_slices} must be >= 1 (or -1: detect)")
    if found > 1 and found != parallelism.num_slices:
        raise ConfigError(
            f"num_slices={parallelism.num_slices} but the devices span {found} slices"
        )
    return parallelism.num_slices


def slice_major(devices: Sequence[Any]) -> list:
    """`devices` ordered slice by slice (then by id), so each slice is one block of the mesh."""
    return sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))


def slice_of(mesh_devices: np.ndarray, num_slices: int) -> list[int]:
    """The slice of each device in the mesh's order (its logical device id in the
    compiled program): its `slice_index`, else its rank by id in `num_slices` equal
    blocks (emulated slices, GPU hosts: ids run slice by slice). For
    hlo_tools.slice_traffic when a slice is no contiguous block of the mesh."""
    flat = list(mesh_devices.flat)
    if detected_slices(flat) > 1:
        return [d.slice_index for d in flat]
    rank = {d.id: i for i, d in enumerate(sorted(flat, key=lambda d: d.id))}
    per_slice = len(flat) // num_slices
    return [rank[d.id] // per_slice for d in flat]


def slice_axes(mesh_shape: dict[str, int], dcn: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """The token (batch) axes whose devices sit in different slices: the dcn_ axes of
    size > 1 and, when its cross-slice part in `dcn` (config.dcn_parts) is > 1, the
    'expert' axis. A reader (accum's hierarchical policy and cost model) takes all of
    such an axis for cross-slice: the expert axis' in-slice part with it (its
    reductions deferred with the dcn_ axes'; the DCN time an upper bound). 'stage'
    is left out: no gradient reduces over it (its cross-slice traffic is the
    pipeline's sends between stages)."""
    axes = [a for a in DCN_AXES if mesh_shape.get(a, 1) > 1]
    if (dcn or {}).get("expert", 1) > 1 and mesh_shape.get("expert", 1) > 1:
        axes.append("expert")
    return tuple(axes)


def _leftover_stage(sizes: dict[str, int], found: int) -> dict[str, int]:
    """The cross-slice parts when the caller gives none: 'stage' takes the slices
    the dcn_ axes leave (no cross-slice expert part)."""
    dcn_stage = max(found // math.prod(sizes.get(a, 1) for a in DCN_AXES), 1)
    return {STAGE_AXIS: dcn_stage if sizes.get(STAGE_AXIS, 1) % dcn_stage == 0 else 1}


def _slice_blocks(
    devices: Sequence[Any], ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...]
) -> np.ndarray:
    """`devices` (slice by slice) as the mesh of shape ici x dcn per axis: slice k is
    `devices`' k-th block, placed at the k-th index (row-major) of the dcn parts and
    each axis' cross-slice part major (the order create_hybrid_device_mesh gives).
    With only the outer dcn_ axes crossing slices this is the plain reshape."""
    n = len(ici_shape)
    blocks = np.asarray(devices).reshape(dcn_shape + ici_shape)
    interleaved = [i for axis in range(n) for i in (axis, n + axis)]
    shape = tuple(d * i for d, i in zip(dcn_shape, ici_shape, strict=True))
    return blocks.transpose(interleaved).reshape(shape)


def device_array(
    sizes: dict[str, int], devices: Sequence[Any], dcn: Mapping[str, int] | None = None
) -> np.ndarray:
    """`devices` laid out as the mesh: shape `sizes` in MESH_AXES order (absent: 1).

    Devices spanning several slices by their `slice_index` (real multi-slice TPU,
    and a multi-slice AOT compile's topology devices) get MaxText's hybrid mesh,
    `mesh_utils.create_hybrid_device_mesh`: one slice per index along the dcn_
    axes, and inside it the ICI topology's layout (`create_device_mesh`, as
    `jax.make_mesh` lays out one slice), physical axes split where a shape needs it.
    Otherwise (CPU devices emulating slices, one slice), or when that layout is
    refused (a warning gives the reason): `devices` in the order given (callers
    pass them `slice_major`), block k of them slice k (`_slice_blocks`).

    `dcn`: the cross-slice part of each HYBRID_AXES axis (config.dcn_parts: 'stage'
    and 'expert'); without it 'stage' takes the slices the dcn_ axes leave and
    'expert' stays inside a slice.
    """
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    found = detected_slices(devices)
    hybrid = dict(dcn) if dcn is not None else _leftover_stage(sizes, found)
    for axis, part in hybrid.items():
        if sizes.get(axis, 1) % part:
            raise ConfigError(
                f"the {axis} axis ({sizes.get(axis, 1)}) does not split into its "
                f"cross-slice part ({part})"
            )
    dcn_sizes = {**{a: sizes.get(a, 1) for a in DCN_AXES}, **hybrid}
    dcn_shape = tuple(dcn_sizes.get(a, 1) for a in MESH_AXES)
    ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape, strict=True))
    if found > 1 and found == math.prod(dcn_shape):
        try:
            return mesh_utils.create_hybrid_device_mesh(
                ici_shape, dcn_shape, devices, allow_split_physical_axes=True
            )
        except (ValueError, NotImplementedError) as error:
            warnings.warn(
                f"the hybrid device mesh (ici {ici_shape} x dcn {dcn_shape} over {found} "
                f"slices) was refused ({error}); placing the devices slice by slice, by id",
                stacklevel=2,
            )
    return _slice_blocks(devices, ici_shape, dcn_shape)
