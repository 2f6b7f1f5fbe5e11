"""Slices: how many, which devices belong to each, and the mesh axes that cross them.

A multi-slice run joins several TPU slices over DCN. The trainer's mesh gives the
cross-slice part its own outermost axes (config.DCN_AXES), so one slice is a
contiguous block of the mesh. On real slices the count comes from the devices'
`slice_index`; on CPU, `num_slices=N` emulates N slices as equal contiguous
blocks of the devices; an AOT compile takes `compile_topology_num_slices`.
Devices that report their slice are placed as MaxText places them
(`device_array`: the hybrid device mesh, each slice laid out by its ICI topology).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
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


def slice_axes(mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (size > 1) whose devices sit in different slices."""
    return tuple(a for a in DCN_AXES if mesh_shape.get(a, 1) > 1)


def device_array(sizes: dict[str, int], devices: Sequence[Any]) -> np.ndarray:
    """`devices` laid out as the mesh: shape `sizes` in MESH_AXES order (absent: 1).

    Devices spanning several slices by their `slice_index` (real multi-slice TPU,
    and a multi-slice AOT compile's topology devices) get MaxText's hybrid mesh,
    `mesh_utils.create_hybrid_device_mesh`: one slice per index along the dcn_
    axes, and inside it the ICI topology's layout (`create_device_mesh`, as
    `jax.make_mesh` lays out one slice), physical axes split where a shape needs it.
    Otherwise (CPU devices emulating slices, one slice), or when that layout is
    refused (a warning gives the reason): `devices` reshaped in the order given
    (callers pass them `slice_major`).
    """
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    found = detected_slices(devices)
    # The 'stage' axis' cross-slice part (dcn_pipeline_parallelism): the slices the
    # dcn_ axes leave (mesh_shape made their product the slice count).
    dcn_stage = max(found // math.prod(sizes.get(a, 1) for a in DCN_AXES), 1)
    if sizes.get(STAGE_AXIS, 1) % dcn_stage:
        dcn_stage = 1
    dcn_sizes = {**{a: sizes.get(a, 1) for a in DCN_AXES}, STAGE_AXIS: dcn_stage}
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
    return np.asarray(devices).reshape(shape)
