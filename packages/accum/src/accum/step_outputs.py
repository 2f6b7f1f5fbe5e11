"""A step's outputs laid out like its inputs, so its executable takes them back.

On an auto mesh XLA chooses where each output lives, and may put an updated
parameter elsewhere than the parameter came in (a replicated kernel sharded
over 'model', say). The compiled executable then refuses its own outputs at
the next step (issue #54). `pinned` constrains each output that mirrors an
input of the same position (same tree, shapes and dtypes: the parameters and
optimizer state of `step(params, state, batch) -> (params, state, ...)`) to
that input's sharding, so the user need not pin `out_shardings`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding


def _auto(sharding: Any) -> bool:
    """A NamedSharding on a mesh of Auto axes only: where XLA chooses the output's.
    On Explicit axes the output's type already says where it lives."""
    if not isinstance(sharding, NamedSharding):
        return False
    return all(t == AxisType.Auto for t in sharding.mesh.axis_types)


def _mirrors(out: Any, arg: Any) -> bool:
    """Same tree, and every leaf of the same shape and dtype."""
    if jax.tree.structure(out) != jax.tree.structure(arg):
        return False
    pairs = zip(jax.tree.leaves(out), jax.tree.leaves(arg), strict=True)
    return all(_aval(o) == _aval(a) for o, a in pairs)


def _aval(x: Any) -> tuple:
    return (getattr(x, "shape", None), getattr(x, "dtype", None))


def pinned(fn: Callable, args: tuple) -> Callable:
    """`fn` with each output mirroring the argument of its position (when the
    outputs are a tuple or list) constrained to that argument's sharding."""
    shardings = [jax.tree.map(lambda x: getattr(x, "sharding", None), a) for a in args]
    if not any(_auto(s) for s in jax.tree.leaves(shardings)):
        return fn

    def step(*call_args, **kwargs):
        out = fn(*call_args, **kwargs)
        if not isinstance(out, tuple | list):
            return out
        fixed = list(out)
        for i, (o, a, s) in enumerate(zip(out, args, shardings, strict=False)):
            if _mirrors(o, a):
                # A hint XLA honours for an output: the input's own layout.
                fixed[i] = jax.tree.map(
                    lambda x, s: jax.lax.with_sharding_constraint(x, s) if _auto(s) else x, o, s
                )
        return type(out)(fixed)

    return step
