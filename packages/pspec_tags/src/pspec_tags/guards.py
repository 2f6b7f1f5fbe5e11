"""Trace-time guards: did every gradient keep its `unreduced` tag?"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import jax

from pspec_tags.specs import unreduced_axes
from pspec_tags.values import spec_of


class TagLostError(RuntimeError):
    """A gradient that should be unreduced over the batch axes is not.

    Numerics would be unchanged; the all-reduce of that gradient would run
    inside the accumulation loop instead of once per step.
    """


def find_untagged(tree: Any, axes: Iterable[str]) -> list[str]:
    """Key paths (as `jax.tree_util.keystr`) of leaves not unreduced over all `axes`.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> with jax.set_mesh(mesh):
    ...     g_D = jax.reshard(jnp.zeros(4), P(unreduced={"data"}))
    >>> pt.find_untagged({"w": g_D, "b": jnp.zeros(2)}, {"data"})
    ["['b']"]
    """
    want = frozenset(axes)
    missing = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = spec_of(leaf)
        if spec is None or not want <= unreduced_axes(spec):
            missing.append(jax.tree_util.keystr(path))
    return missing


def check_unreduced(tree: Any, axes: Iterable[str], *, warn_only: bool = False) -> None:
    """Raise TagLostError naming every leaf of `tree` not unreduced over `axes`.

    Call it at trace time on a microbatch's gradients. With `warn_only`, emit a
    RuntimeWarning instead of raising.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> pt.check_unreduced({"b": jnp.zeros(2)}, {"data"})
    Traceback (most recent call last):
    ...
    pspec_tags.guards.TagLostError: 1 gradient(s) lost their unreduced tag over ('data',); ...
    """
    axes = tuple(sorted(axes))
    missing = find_untagged(tree, axes)
    if not missing:
        return
    leaves = dict(
        (jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
    listing = "\n".join(f"  {path}: {jax.typeof(leaves[path])}" for path in missing)
    message = (
        f"{len(missing)} gradient(s) lost their unreduced tag over {axes}; their all-reduce "
        f"would run once per microbatch instead of once per step:\n{listing}\n"
        "Look for a reshard onto a spec rebuilt from logical rules (use carry_reduced_axes) "
        "or an elementwise op with a batch-sharded activation (use broadcast_param)."
    )
    if warn_only:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise TagLostError(message)
