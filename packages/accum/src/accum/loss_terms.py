"""The terms of a traced loss and what each is divided by: the jaxpr walk behind
accum's loss-contract probe (accum.contract_probe).

Each value of the jaxpr is labelled with what it is computed from (`labels`: the
batch's rows, the parameters, and whether a gradient reaches it from them); the
loss's scalar-level sums are followed into their terms, and each term read for the
divisor of a mean (a count of the rows, or a constant, compared across two traces by
the probe) or as a term of the parameters alone (`divisors`). Constants a trace keeps
as arithmetic on literals are folded (`1e-2 * jnp.float32(rows) * 0.5`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.extend.core import Literal

# Ops through which `loss_sum` is still the value of their first operand.
_PASS = {"convert_element_type", "neg", "copy", "copy_p", "reshape", "squeeze", "reduce_precision"}
# Ops whose value is the sum (or difference) of their operands: each one a term of the loss.
_SUMS = {"add", "sub", "add_any"}
# Ops that spread or cast a value without changing what it counts.
_SPREAD = {"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims", "copy"}
# What a value is computed from: the batch's rows, the parameters, and whether the
# parameters reach it through values that carry a gradient (a count of a loss's
# non-NaN entries, `jnp.nanmean`'s, is computed from them through a bool: no gradient).
ROWS, PARAM, GRAD = "rows", "param", "grad"


def _inner(eqn: Any) -> Any:
    """The jaxpr a call-like equation runs (jit, checkpoint, custom_jvp/vjp), or None."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        found = eqn.params.get(name)
        if found is not None and not callable(found):
            return getattr(found, "jaxpr", found)
    return None


def _label(labels: dict, var: Any) -> frozenset:
    """What `var` is computed from; nothing for a literal (literals are unhashable)."""
    return frozenset() if isinstance(var, Literal) else labels.get(var, frozenset())


def _labels(jaxpr: Any, in_labels: list[frozenset]) -> dict:
    """{var: what it is computed from} (parameters, batch rows), over the equations."""
    labels = dict(zip(jaxpr.invars, in_labels, strict=True))
    for eqn in jaxpr.eqns:
        found = frozenset().union(*(_label(labels, v) for v in eqn.invars))
        for out in eqn.outvars:
            # A bool or integer value carries no gradient (a comparison, a count).
            inexact = jnp.issubdtype(getattr(out.aval, "dtype", jnp.float32), jnp.inexact)
            labels[out] = found if inexact else found - {GRAD}
    return labels


def divisors(jaxpr: Any, var: Any, in_labels: list[frozenset]) -> list:
    """What each added term of `var` (the loss) is finally divided by, in the order
    the terms are found: ("const", value) for constant divisors and multipliers
    (`x / 8`, `x * 0.125`, `0.125 * x`, folded into one value; a constant is a literal
    or arithmetic on literals), ("rows", None) for a value computed from the batch's
    rows and not the parameters (`x / mask.sum()`, `x * (1 / mask.sum())`), ("param",
    value) for a term of the parameters alone, with its constant divisor. A term with
    none of these has no entry. Scalar sums and
    differences are followed into each operand (`jnp.mean(l) + penalty` is a mean
    term plus another), a final product's factors only to their own producers;
    casts, reshapes, `reduce_sum` and call-like equations through."""
    labels = _labels(jaxpr, in_labels)
    producers = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    found: list = []
    constants: dict = {}  # var -> its value where fixed at trace time (`constant`)

    def rows_only(v: Any) -> bool:
        label = _label(labels, v)
        return ROWS in label and GRAD not in label

    def unspread(v: Any) -> Any:
        # `v` before the broadcasts and casts that only spread or retype it.
        while not isinstance(v, Literal) and v in producers:
            if producers[v].primitive.name not in _SPREAD:
                break
            v = producers[v].invars[0]
        return v

    def scalar_of_rows(v: Any) -> bool:
        # A 0-d value computed from the rows alone (a mask's sum, a row count): the
        # whole microbatch's count, not a per-row one (a per-sequence normalization
        # inside the sum is a sum over rows and passes).
        v = unspread(v)
        return not isinstance(v, Literal) and rows_only(v) and v.aval.shape == ()

    def divided_by_rows(v: Any) -> bool:
        # `x / count` or `count ** -1` (jnp.reciprocal) for such a count.
        eqn = None if isinstance(v, Literal) else producers.get(v)
        if eqn is None:
            return False
        if eqn.primitive.name == "div":
            return scalar_of_rows(eqn.invars[1])
        if eqn.primitive.name == "integer_pow" and eqn.params.get("y", 0) < 0:
            return scalar_of_rows(eqn.invars[0])
        return False

    def constant(v: Any) -> float | None:
        # A scalar fixed at trace time: a literal, or arithmetic on literals that the
        # trace kept as equations (`1e-2 * jnp.float32(rows) * 0.5` is two `mul`s of
        # literals); None for anything else.
        if isinstance(v, Literal):
            return _scalar(v.val)
        if v not in constants:
            constants[v] = None  # also while its operands are read (no cycles in a jaxpr)
            eqn = producers.get(v)
            if eqn is not None and v.aval.shape == () and eqn.primitive.name in _ARITHMETIC:
                args = [constant(x) for x in eqn.invars]
                try:
                    value = _ARITHMETIC[eqn.primitive.name](*args, **eqn.params)
                    constants[v] = None if None in args else float(value)
                except (ArithmeticError, TypeError, ValueError):
                    pass
        return constants[v]

    def scaled_by(eqn: Any) -> tuple[float, Any] | None:
        # (the constant, the other operand) of `c * x`, `x * c`; (1 / c, x) of `x / c`.
        values = [constant(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "mul" and len(values) == 2 and values.count(None) == 1:
            i = values.index(None)
            return values[1 - i], eqn.invars[i]
        if name == "div" and values[0] is None and values[1] is not None:
            return 1.0 / _nonzero(values[1]), eqn.invars[0]
        return None

    def factor(v: Any, scale: float) -> None:
        # One factor of the loss's final product (`l * (m / m.sum())`): what it is
        # divided by, read off its own producer only (no walk into the model, where a
        # BatchNorm's division by the rows is no mean of the loss).
        v = unspread(v)
        eqn = None if isinstance(v, Literal) else producers.get(v)
        by = scaled_by(eqn) if eqn is not None and eqn.primitive.name == "div" else None
        if by is not None:
            found.append(("const", scale / by[0]))
        elif divided_by_rows(v):
            found.append(("rows", None))

    def folded_scale(var: Any, scale: float) -> float | None:
        # `scale` with the constant multipliers and divisors above `var` folded in (a
        # penalty's `0.5 * ...`, `... * jnp.float32(rows)`); None for a term times 0.
        while not isinstance(var, Literal) and var in producers:
            eqn = producers[var]
            if eqn.primitive.name in _PASS:
                var = eqn.invars[0]
            elif (by := scaled_by(eqn)) is not None:
                if by[0] == 0.0:
                    return None
                scale, var = scale / by[0], by[1]
            else:
                break
        return scale

    def walk(var: Any, scale: float) -> None:
        label = _label(labels, var)
        if GRAD in label and ROWS not in label:
            # A term of the parameters alone (no batch value in it: an L2 penalty): its
            # divisor, compared across the two traces (weighted by a static row count
            # it shrinks as the rows double; added as it is it stays).
            folded = folded_scale(var, scale)
            if folded is not None:
                found.append(("param", folded))
            return
        while not isinstance(var, Literal) and var in producers:
            eqn = producers[var]
            name = eqn.primitive.name
            if name in _PASS or name == "reduce_sum":
                # A sum of terms each divided by the count is divided by it too.
                var = eqn.invars[0]
            elif name in _SUMS and eqn.outvars[0].aval.shape == ():
                # The loss's own terms (scalars): below its final sums an addition is
                # the model's (a residual), not a term of the loss.
                for term in eqn.invars:
                    walk(term, scale)
                return
            elif (by := scaled_by(eqn)) is not None:
                scale, var = scale / _nonzero(by[0]), by[1]
            elif name in ("mul", "dot_general"):
                # A product is divided by whatever one of its factors is.
                for v in eqn.invars:
                    if constant(v) is None:
                        factor(v, scale)
                break
            elif name == "div":
                if scalar_of_rows(eqn.invars[1]):
                    found.append(("rows", None))
                    return
                break
            elif (inner := _inner(eqn)) is not None and len(inner.outvars) == len(eqn.outvars):
                inner_labels = [_label(labels, v) for v in eqn.invars]
                if len(inner_labels) != len(inner.invars):
                    break
                terms = divisors(inner, inner.outvars[eqn.outvars.index(var)], inner_labels)
                found.extend((k, v * scale if k in ("const", "param") else v) for k, v in terms)
                if terms:
                    return
                break
            else:
                break
        if scale != 1.0:
            found.append(("const", scale))

    walk(var, 1.0)
    return found


def _scalar(value: Any) -> float | None:
    """A literal's value as a float, None where it is no scalar number."""
    try:
        return float(value) if jnp.ndim(value) == 0 else None
    except (TypeError, ValueError):
        return None


def _nonzero(value: float) -> float:
    """`value`, or 1.0 for 0 (a scale of 0 reads nothing it could be divided by)."""
    return value if value != 0.0 else 1.0


# Scalar arithmetic a trace keeps as equations on literals (`constant` evaluates it).
_ARITHMETIC = {
    "mul": lambda a, b, **_: a * b,
    "div": lambda a, b, **_: a / b,
    "add": lambda a, b, **_: a + b,
    "sub": lambda a, b, **_: a - b,
    "neg": lambda a, **_: -a,
    "convert_element_type": lambda a, **_: a,
    "copy": lambda a, **_: a,
    "integer_pow": lambda a, y, **_: a**y,
}  # parameters other than `y` (an out_dtype, a sharding) change no value
