"""Partitioning written on the parameters themselves, and the batch axes of an
auto mesh (issue #54).

Flax users say how a parameter is split where they create it:
`nn.with_partitioning` boxes the value in an axis-metadata object (an
`nn.Partitioned` with mesh axis names), `nnx.with_partitioning` stores the names
in the `nnx.Variable`'s metadata. Read by duck typing: accum does not import
Flax.

Two uses. On an auto mesh the traced types carry no shardings, so the axes a
parameter is annotated over are the only sign, inside `jax.jit`, of which axes
the model keeps for itself (a 'model' axis): those are never batch axes.
And linen's boxes are taken off before `loss_fn` sees the parameters
(`unboxed`): unboxing applies a `with_sharding_constraint`, which refers to
axes that are manual inside accum's local path (and is an assertion on an
explicit mesh); the gradients get the boxes back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from pspec_tags import entry_axes, partitions

# Traced values' shardings are their types' (nothing on an auto mesh); `jax.core.Tracer`
# is looked up softly, as JAX keeps moving what `jax.core` exports.
_TRACER = getattr(jax.core, "Tracer", ())
# nnx.Variable metadata keys naming mesh axes per dimension, across Flax versions.
_NNX_KEYS = ("out_sharding", "sharding_names", "sharding")


def is_box(x: Any) -> bool:
    """A linen axis-metadata box (`nn.Partitioned`, `nn.LogicallyPartitioned`)."""
    return hasattr(x, "unbox") and hasattr(x, "replace_boxed") and hasattr(x, "names")


def _is_variable(x: Any) -> bool:
    return callable(getattr(x, "get_metadata", None)) and hasattr(x, "get_value")


def _names(x: Any) -> tuple:
    """The per-dimension axis names annotated on a box or nnx Variable, or ()."""
    if is_box(x):
        return tuple(x.names or ())
    if _is_variable(x):
        meta = x.get_metadata()
        for key in _NNX_KEYS:
            if isinstance(meta.get(key), tuple | jax.sharding.PartitionSpec):
                return tuple(meta[key])
    return ()


def _concrete_spec(x: Any) -> tuple:
    """The partitions of a placed (not traced) array's NamedSharding, or ()."""
    if _TRACER and isinstance(x, _TRACER):
        return ()
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return tuple(partitions(spec)) if spec is not None else ()


_PLACED = threading.local()


@contextlib.contextmanager
def placed(args: Any) -> Iterator[None]:
    """While `compile_checked` traces: the shardings of its placed arguments, by
    (shape, dtype), so a traced leaf on an auto mesh can be matched to the array
    it stands for (`_placed_spec`)."""
    table: dict[tuple, set[tuple]] = {}
    for leaf in jax.tree.leaves(args):
        spec = _concrete_spec(leaf)
        if spec and hasattr(leaf, "shape"):
            table.setdefault(_key(leaf), set()).add(spec)
    previous, _PLACED.table = getattr(_PLACED, "table", None), table
    try:
        yield
    finally:
        _PLACED.table = previous


def _key(x: Any) -> tuple:
    return tuple(x.shape), str(x.dtype)


def _placed_spec(x: Any) -> tuple:
    """The partitions of the one placed argument of `x`'s shape and dtype (under
    `placed`); () where none, or several laid out differently, match."""
    table = getattr(_PLACED, "table", None) or {}
    specs = table.get(_key(x), set()) if hasattr(x, "shape") else set()
    return next(iter(specs)) if len(specs) == 1 else ()


def _spec(x: Any) -> tuple:
    """Where `x` lives: its own sharding if placed, else its match under `placed`."""
    return _concrete_spec(x) or _placed_spec(x)


def annotated_axes(params: Any) -> frozenset[str]:
    """Mesh axes some parameter is annotated (or, when placed, sharded) over."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: is_box(x) or _is_variable(x))
    axes = set()
    for leaf in leaves:
        value = leaf.get_value() if _is_variable(leaf) else getattr(leaf, "value", leaf)
        for entry in _names(leaf) or _spec(value):
            axes.update(entry_axes(entry))
    return frozenset(axes)


def auto_batch_axes(batch: Any, sizes: Mapping[str, int], model_axes: frozenset[str]) -> tuple:
    """An auto mesh's default batch axes: those sharding the batch's leading
    dimension where the batch is placed (not traced, or matched under
    `placed`); else every axis of size > 1 no parameter is annotated over
    (`annotated_axes`)."""
    read = []
    for leaf in jax.tree.leaves(batch):
        for axis in entry_axes((_spec(leaf) or (None,))[0]):
            if sizes.get(axis, 1) > 1 and axis not in read:
                read.append(axis)
    if read:
        return tuple(read)
    every = tuple(a for a, n in sizes.items() if n > 1)
    # Every axis annotated (FSDP over 'data' too): nothing tells them apart; all.
    return tuple(a for a in every if a not in model_axes) or every


def _unbox(box: Any) -> Any:
    try:  # without the constraint: see the module docstring
        return box.unbox(apply_constraint=False)
    except TypeError:  # an AxisMetadata whose unbox takes no argument
        return box.unbox()


def unboxed(params: Any) -> tuple[Any, Callable[[Any], Any]]:
    """(params without linen's boxes, a function boxing a gradient tree alike)."""
    if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
        return params, lambda tree: tree
    raw = jax.tree.map(lambda x: _unbox(x) if is_box(x) else x, params, is_leaf=is_box)

    def rebox(tree: Any) -> Any:
        return jax.tree.map(
            lambda x, g: x.replace_boxed(g) if is_box(x) else g, params, tree, is_leaf=is_box
        )

    return raw, rebox
