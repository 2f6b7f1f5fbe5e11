"""Sharding a parameter-shaped array over more mesh axes: ZeRO-1's shards and the
hierarchical plan's scattered accumulators share this layout."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from jax.sharding import PartitionSpec as P

from pspec_tags import entry_axes, entry_from_axes, mesh_axes_used, partitions, untagged


def add_axis_to_free_dim(
    spec: P, shape: tuple[int, ...], sizes: Mapping[str, int], axis: str, free_only: bool = False
) -> P:
    """`spec` (untagged) with `axis` added to the first dimension it divides,
    unsharded dimensions first (only those with `free_only`); unchanged when
    `axis` already shards it or divides no dimension (too small to split)."""
    parts = list(partitions(spec)) + [None] * (len(shape) - len(partitions(spec)))
    if axis in mesh_axes_used(spec):
        return untagged(spec)
    for want_free in (True,) if free_only else (True, False):
        for d, entry in enumerate(parts):
            axes = entry_axes(entry)
            if want_free == bool(axes):
                continue
            if shape[d] % (math.prod(sizes[a] for a in axes) * sizes[axis]) == 0:
                new = (*axes, axis)
                parts[d] = entry_from_axes(new)
                return P(*parts)
    return P(*parts)


def add_axes_to_free_dims(
    spec: P, shape: tuple[int, ...], sizes: Mapping[str, int], axes: Iterable[str]
) -> P:
    """`add_axis_to_free_dim` (unsharded dimensions only) for each of `axes` in turn."""
    spec = untagged(spec)
    for axis in axes:
        spec = add_axis_to_free_dim(spec, shape, sizes, axis, free_only=True)
    return spec
