"""Trace-time guard: does the model drop a parameter's `reduced` tag?

Checking the gradients' types is not enough. Autodiff types a reduced
parameter's cotangent as unreduced no matter what the model does with it: if
the model reshards the parameter onto an untagged spec, the backward pass
all-reduces the gradient right there (inside the microbatch loop, often inside
the layer loop too) and then converts the fully reduced value back into an
"unreduced" one. Numerics and output types are unchanged; only the traffic
grows. So the guard reads the forward jaxpr instead: a layout op (reshard,
mesh_cast, sharding constraint) or a nested-jaxpr boundary (jit, scan, shard_map,
remat, custom_vjp) that takes a value reduced over the deferred axes and hands
on one that is not, is a dropped tag. Each parameter's leaves are followed
through the program so the error can name them.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from pspec_tags import TagLostError, reduced_axes

# Primitives that change only a value's layout: passing a reduced value through
# one of them onto an untagged spec is exactly the silent drop.
_LAYOUT_PRIMITIVES = frozenset({"reshard", "mesh_cast", "sharding_constraint", "device_put"})


def _reduced(var: Any) -> frozenset[str]:
    """Axes `var` is reduced over: from its sharding, or (inside a shard_map, where
    those axes are manual) from its manual axis type."""
    aval = getattr(var, "aval", None)
    sharding = getattr(aval, "sharding", None)
    manual = getattr(getattr(aval, "manual_axis_type", None), "reduced", None) or ()
    return reduced_axes(getattr(sharding, "spec", None)) | frozenset(manual)


def _is_literal(var: Any) -> bool:
    return type(var).__name__ == "Literal"


def _jaxpr_of(obj: Any) -> Any | None:
    inner = getattr(obj, "jaxpr", None)  # ClosedJaxpr -> Jaxpr
    if inner is not None and hasattr(inner, "eqns"):
        return inner
    return obj if hasattr(obj, "eqns") else None


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, list[int]]]:
    """(sub-jaxpr, outer invar index for each of its invars) for every nested jaxpr."""
    n = len(eqn.invars)
    if eqn.primitive.name == "while":
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = list(range(cn + bn, n))
        body = _jaxpr_of(eqn.params["body_jaxpr"])
        return [(body, list(range(cn, cn + bn)) + carry)]
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            sub = _jaxpr_of(item)
            if sub is None:
                continue
            if len(sub.invars) == n:  # jit, scan, remat, shard_map, custom_vjp/jvp
                found.append((sub, list(range(n))))
            elif len(sub.invars) == n - 1:  # cond branches: operand 0 is the index
                found.append((sub, list(range(1, n))))
    return found


def _where(eqn: Any) -> str:
    try:  # best effort: the user's source line, through a private helper
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - location is decoration only
        return "?"


def _walk(jaxpr: Any, taint: dict, axes: frozenset, found: dict[str, list[str]]) -> None:
    for eqn in jaxpr.eqns:
        in_taint = [
            frozenset() if _is_literal(v) else taint.get(v, frozenset()) for v in eqn.invars
        ]
        for sub, mapping in _sub_jaxprs(eqn):
            sub_taint = {}
            for sub_var, outer in zip(sub.invars, mapping, strict=False):
                names = in_taint[outer]
                if not names:
                    continue
                sub_taint[sub_var] = names
                lost = (_reduced(eqn.invars[outer]) & axes) - _reduced(sub_var)
                if lost:
                    _record(found, names, eqn, eqn.invars[outer], sub_var, lost)
            _walk(sub, sub_taint, axes, found)
        if eqn.primitive.name in _LAYOUT_PRIMITIVES:
            for var, names in zip(eqn.invars, in_taint, strict=False):
                for out in eqn.outvars:
                    lost = (_reduced(var) & axes) - _reduced(out)
                    if names and lost:
                        _record(found, names, eqn, var, out, lost)
        union = frozenset().union(*in_taint)
        if union:
            for out in eqn.outvars:
                taint[out] = union


def _record(found, names, eqn, src, dst, lost) -> None:
    what = (
        f"{eqn.primitive.name}: {src.aval} -> {dst.aval} drops reduced {sorted(lost)} "
        f"at {_where(eqn)}"
    )
    for name in sorted(names):
        if what not in found.setdefault(name, []):
            found[name].append(what)


def find_dropped_tags(
    loss_fn: Any, params: Any, *args: Any, axes: tuple[str, ...]
) -> dict[str, list[str]]:
    """Parameters whose `reduced` tag over `axes` the forward pass of `loss_fn` drops.

    Traces `loss_fn(params, *args)` (no compute) and returns
    `{key path: [where the tag is dropped, ...]}`; empty when every tag survives
    until the value is consumed by compute (a matmul, a broadcast with an
    explicit out_sharding, a gather). Best effort through nested jaxprs whose
    operands map one-to-one onto their inputs (jit, scan, while, cond, remat,
    shard_map, custom_vjp/jvp).
    """
    if not axes:
        return {}
    closed = jax.make_jaxpr(loss_fn)(params, *args)
    jaxpr = closed.jaxpr
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    taint = {var: frozenset({path}) for var, path in zip(jaxpr.invars, paths, strict=False)}
    found: dict[str, list[str]] = {}
    _walk(jaxpr, taint, frozenset(axes), found)
    return found


def report_dropped_tags(
    found: dict[str, list[str]], axes: tuple[str, ...], on_tag_lost: str
) -> None:
    """Raise `TagLostError` (or warn, with on_tag_lost="warn") naming each parameter in `found`."""
    if not found:
        return
    lines = [
        f"{len(found)} parameter(s) lose their reduced tag over {tuple(sorted(axes))} inside "
        "loss_fn; their gradient all-reduce would run once per microbatch (and per layer) "
        "instead of once per step:"
    ]
    for name, sites in sorted(found.items()):
        lines.extend(f"  {name}: {site}" for site in sites)
    lines.append(
        "Reshard parameters onto carry_reduced_axes(spec, param) instead of a spec rebuilt "
        "from logical rules; use broadcast_param / embed_lookup for elementwise use and lookups."
    )
    message = "\n".join(lines)
    if on_tag_lost == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise TagLostError(message)
