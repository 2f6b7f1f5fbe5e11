"""Collectives over a batch axis inside `loss_fn`: which are the model's, which a wrong gradient.

accum runs `loss_fn` on one device's rows of each microbatch (the local path's
shard_map) and sums the devices' `loss_sum`s, weights and gradients itself,
once per step. A `loss_fn` written for `pmap` often reduces its loss over the
batch axis too (`jax.lax.pmean(loss, "data")`): then every device returns the
same, already reduced, value; the sum of the devices' losses still looks right,
but each device's gradient is that of the mean, so the step's gradient comes out
divided by the number of devices. The same holds for a weight summed over the
axis (`lax.psum(mask.sum(), "data")`).

Not every collective over a batch axis is that mistake: sync BatchNorm
(`nn.BatchNorm(axis_name="data")`, linen or nnx) averages its batch statistics
over the axis, and each device's loss still depends on its own rows. What tells
them apart is the type JAX gives the result inside the shard_map: a value that
depends on a device's own rows is *varying* over the batch axes, one that was
reduced over an axis is not. So `check_loss_types` asks that of `loss_sum` (the
rows vary over the axes, the loss does not: refused) and of the weight (not
varying *and* computed by a collective over the axis: refused; a constant count
like `jnp.float32(rows)` is not varying either, and right). The error names the
axis and the collective, found in the loss's jaxpr (`collectives_over`, through
jit, scan, cond, remat and custom_vjp/jvp calls), with its source line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import Literal

from accum.jaxpr_regions import nested_regions, open_jaxpr
from accum.jaxpr_types import manual_axes
from accum.source_lines import where

# Collectives whose result no longer varies over the axes they name.
REDUCING = frozenset(
    {
        "psum",
        "psum2",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "pmean",
    }
)


def _named_axes(params: dict) -> frozenset[str]:
    """The mesh axes a collective's parameters name (`axes` or `axis_name`)."""
    axes = params.get("axes", params.get("axis_name", ()))
    return frozenset(a for a in (axes if isinstance(axes, tuple | list) else (axes,)) if a)


def _nested(eqn: Any) -> Iterator[Any]:
    """The open jaxprs nested anywhere in `eqn`'s parameters."""
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            sub = open_jaxpr(item)
            if sub is not None:
                yield sub


def collectives_over(jaxpr: Any, axes: frozenset[str]) -> list[tuple[str, str, str]]:
    """(primitive, axis, source line) of each reducing collective over one of
    `axes` in `jaxpr` and every jaxpr nested in it, in order of appearance."""
    found = []
    for eqn in open_jaxpr(jaxpr).eqns:
        if eqn.primitive.name in REDUCING:
            for axis in sorted(_named_axes(eqn.params) & axes):
                found.append((eqn.primitive.name, axis, where(eqn, depth=1)))
        for sub in _nested(eqn):
            found.extend(collectives_over(sub, axes))
    return found


def _sources(jaxpr: Any, out_index: int, axes: frozenset[str]) -> list[tuple[str, str, str]]:
    """The reducing collectives over `axes` that output `out_index` of `jaxpr`
    depends on: a backward walk over the top-level equations, an equation with
    nested jaxprs counted by every collective inside it."""
    jaxpr = open_jaxpr(jaxpr)
    wanted = {id(jaxpr.outvars[out_index])}
    found: list[tuple[str, str, str]] = []
    for eqn in reversed(jaxpr.eqns):
        if not any(id(v) in wanted for v in eqn.outvars):
            continue
        if eqn.primitive.name in REDUCING:
            found += [
                (eqn.primitive.name, a, where(eqn, 1))
                for a in sorted(_named_axes(eqn.params) & axes)
            ]
        for sub in _nested(eqn):
            found += collectives_over(sub, axes)
        wanted.update(id(v) for v in eqn.invars if not isinstance(v, Literal))
    return found[::-1]


def _vma(x: Any) -> frozenset[str]:
    """The manual axes `x` varies over inside a shard_map (empty outside one)."""
    return manual_axes(x, "varying") if hasattr(x, "aval") else frozenset()


def check_loss_types(
    loss_fn: Callable, args: tuple, loss_sum: Any, weight: Any, rows: Any, axes: tuple[str, ...]
) -> None:
    """ValueError, one line, where `loss_fn` reduced its loss or weight over a batch axis.

    Call inside the local path's shard_map, with `loss_sum` and `weight` what
    `loss_fn(*args)` returned for the device's `rows`. Only the axes the rows
    vary over are judged (a shard_map traced without varying types judges none).
    """
    tracked = frozenset(axes) & frozenset().union(*(_vma(x) for x in jax.tree.leaves(rows)))
    lost = [
        (what, tracked - _vma(x)) for what, x in (("loss_sum", loss_sum), ("aux['weight']", weight))
    ]
    if not any(axes for _, axes in lost):
        return
    jaxpr = jax.make_jaxpr(lambda *a: (lambda out: (out[0], out[1]["weight"]))(loss_fn(*a)))(*args)
    for index, (what, axes_lost) in enumerate(lost):
        sites = _sources(jaxpr.jaxpr, index, axes_lost) if axes_lost else []
        if sites:  # a constant (a count, a zero) is not varying either, and right
            raise ValueError(_message(what, sorted(axes_lost), sites))


# How a primitive is written in user code: pmean is a psum and a division.
_SHOWN = {"psum": "psum/pmean", "psum2": "psum/pmean", "psum_invariant": "psum/pmean"}


def _message(what: str, axes: list[str], sites: list[tuple[str, str, str]]) -> str:
    """The one-line refusal: which value, which axis, which collective and where."""
    named = "; ".join(f"{_SHOWN.get(p, p)} over {a!r} at {line}" for p, a, line in sites[:2])
    return (
        f"accum: loss_fn's {what} is reduced over batch axis {', '.join(map(repr, axes))} "
        f"inside loss_fn ({named}): accum runs loss_fn on each device's rows and sums "
        "the devices' losses, weights and gradients itself, so the gradient would be "
        "divided by the number of devices; return this device's own sum (remove the "
        "psum/pmean over the batch axis; a sync BatchNorm's statistics may keep theirs)"
    )


# ------------------------------------------- the same judgement on a jaxpr traced outside

_Vma = frozenset


def _eqn_vma(eqn: Any, ins: list[_Vma]) -> list[_Vma]:
    """What `eqn`'s outputs vary over, given its inputs': a reducing collective
    takes its axes away, `axis_index` adds its axis, nested jaxprs are followed
    (loops until their carries settle), anything else keeps the union."""
    name = eqn.primitive.name
    union = frozenset().union(*ins)
    if name in REDUCING:
        return [union - _named_axes(eqn.params)] * len(eqn.outvars)
    if name == "axis_index":
        return [union | _named_axes(eqn.params)] * len(eqn.outvars)
    regions = nested_regions(eqn)
    if not regions:
        return [union] * len(eqn.outvars)
    outs = [frozenset()] * len(eqn.outvars)
    for region in regions:
        sub_in = [ins[i] if i is not None else frozenset() for i in region.ins]
        for _ in range(3):  # carries: at most a few rounds to a fixed point
            sub_out = jaxpr_vma(region.jaxpr, sub_in)
            grown = False
            for out_i, in_i in region.loop:
                if not sub_out[out_i] <= sub_in[in_i]:
                    sub_in[in_i] = sub_in[in_i] | sub_out[out_i]
                    grown = True
            if not grown:
                break
        for j, outer in enumerate(region.outs):
            if outer is not None:
                outs[outer] = outs[outer] | sub_out[j]
    if eqn.primitive.name == "cond":  # the branch taken varies with the index
        outs = [o | ins[0] for o in outs]
    return outs


def jaxpr_vma(jaxpr: Any, in_vma: list[_Vma]) -> list[_Vma]:
    """What each output of `jaxpr` varies over, its inputs varying over `in_vma`
    (its constants over nothing): JAX's varying types inside a shard_map, worked
    out on a jaxpr traced outside one (accum.closure's)."""
    jaxpr = open_jaxpr(jaxpr)
    env: dict[int, _Vma] = {id(v): m for v, m in zip(jaxpr.invars, in_vma, strict=True)}

    def read(v: Any) -> _Vma:
        return frozenset() if isinstance(v, Literal) else env.get(id(v), frozenset())

    for eqn in jaxpr.eqns:
        outs = _eqn_vma(eqn, [read(v) for v in eqn.invars])
        env.update((id(v), m) for v, m in zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def check_lifted(closed: Any, out_shape: Any, axes: tuple[str, ...]) -> None:
    """`check_loss_types`' judgement on `loss_fn`'s jaxpr traced outside the
    shard_map (accum.closure: its inputs one device's params, rows and key, all
    varying over the batch `axes`; closed-over values replicated)."""
    jaxpr = open_jaxpr(closed)
    outs = jaxpr_vma(jaxpr, [frozenset(axes)] * len(jaxpr.invars))
    flat = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    keys = [jax.tree_util.keystr(path) for path, _ in flat]
    for what, key in (("loss_sum", "[0]"), ("aux['weight']", "[1]['weight']")):
        if key not in keys:
            continue
        index = keys.index(key)
        lost = frozenset(axes) - outs[index]
        sites = _sources(jaxpr, index, lost) if lost else []
        if sites:  # a constant (a count, a zero) is not varying either, and right
            raise ValueError(_message(what, sorted(lost), sites))
