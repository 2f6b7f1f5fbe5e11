"""Which mesh axes may carry a deferred gradient reduction, and in which mode we run.

Deferral is only sound for mesh axes that split the *batch* and no *parameter*:
along such an axis every device holds a full copy of each parameter and a
different slice of the data, so each device's gradient is a partial sum and the
sum can wait until the end of the step. An axis that also shards a parameter
(FSDP, tensor or expert parallelism) needs its reduction where the model puts it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from pspec_tags import mesh_axes_used, partitions, spec_of

MODES = ("explicit", "auto")


def resolve_mode(mode: str | None, params: Any) -> str:
    """`mode` if given, else "explicit" when any parameter lives on an Explicit mesh."""
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        return mode
    leaves = jax.tree.leaves(params)
    return "explicit" if any(spec_of(leaf) is not None for leaf in leaves) else "auto"


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or isinstance(entry, type(jax.sharding.PartitionSpec.UNCONSTRAINED)):
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_sizes(leaves: Iterable[Any]) -> dict[str, int]:
    for leaf in leaves:
        if spec_of(leaf) is not None:
            return dict(jax.typeof(leaf).sharding.mesh.shape)
    return {}


def batch_axes_of(batch: Any) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that shard the leading (batch) dimension of `batch`'s leaves.

    Read from the explicit shardings of the leaves, so it works on traced values;
    returns `()` in auto mode, where shardings are not part of the types.
    """
    leaves = jax.tree.leaves(batch)
    sizes = _mesh_sizes(leaves)
    axes: list[str] = []
    for leaf in leaves:
        spec = spec_of(leaf)
        if spec is None or getattr(leaf, "ndim", 0) == 0:
            continue
        # `partitions` reads through tags: a tagged spec refuses `spec[0]`.
        lead = partitions(spec)[:1]
        for axis in _entry_axes(lead[0] if lead else None):
            if sizes.get(axis, 1) > 1 and axis not in axes:
                axes.append(axis)
    return tuple(axes)


def param_mesh_axes(params: Any) -> frozenset[str]:
    """Mesh axes that partition some dimension of some parameter (tags excluded)."""
    return frozenset(a for leaf in jax.tree.leaves(params) for a in mesh_axes_used(spec_of(leaf)))


def deferred_axes(params: Any, batch_axes: Iterable[str]) -> tuple[str, ...]:
    """The batch axes along which the gradient reduction can wait for the end of the step.

    These are the axes of `batch_axes` that shard no parameter and have size > 1.
    Empty in auto mode (no explicit shardings to read, no tags to carry).
    """
    leaves = jax.tree.leaves(params)
    sizes = _mesh_sizes(leaves)
    if not sizes:
        return ()
    used = param_mesh_axes(params)
    return tuple(a for a in batch_axes if sizes.get(a, 1) > 1 and a not in used)


def data_is_only_batch_axis(params: Any, batch_axes: Iterable[str]) -> bool:
    """Whether deferral applies: some batch axis shards the batch and no parameter.

    The gate of the deferred path (named after the seed's helper): when it is
    False, parameters are left untagged and gradients are reduced where the
    model's shardings put them.
    """
    return bool(deferred_axes(params, batch_axes))
