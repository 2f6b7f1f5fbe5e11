"""The loss contract's breaches that only the traced `loss_fn` shows, found before the loop.

accum adds `loss_sum` and every aux value over microbatches and devices and divides
by the summed `aux["weight"]` once per step. Three idioms break that silently (the
result then depends on the number of microbatches and devices, without an error):

- a *mean* as `loss_sum` (`jnp.mean(losses)`, `optax....(...).mean()`,
  `sum(l * mask) / mask.sum()`, `jnp.nanmean`) beside a weight that counts the targets: the loss
  is divided twice, once per microbatch. Found on the jaxpr: `loss_sum` is a
  division (through casts and `jit`/`checkpoint`/custom-derivative calls) by a
  value computed from the batch's rows and not from the parameters (or from them
  only through bools and integers, which carry no gradient: nanmean's count), or by a
  constant that changes when the microbatch's rows double (a per-sequence mean,
  divided by the sequence length, is a sum over rows and passes). `ValueError`;
- a term of the parameters alone added to `loss_sum` (an L2 penalty `+ 0.5 *
  jnp.sum(w * w)`), not weighted by the rows: counted once per microbatch and device,
  where the full batch counts it once. Found on the jaxpr: a scalar term of the loss
  computed from the parameters and no batch value, whose constant multiplier does
  not double with the rows (second trace). `ValueError`;
- a weight that counts nothing (`{"weight": 1}` beside a mean): the same constant
  for the microbatch's rows and for twice as many. accum cannot know a mean was
  meant, so it warns, once, saying what to return. A Python number is always
  compared; an array constant (`jnp.float32(1.0)`; `jnp.float32(rows)` is one
  too, fixed at trace time) only where the second trace is made anyway (beside a
  division), so the common idiom costs no second trace;
- an aux value with a row per example (per-example predictions): summed
  elementwise, it would add different examples' values together. `ValueError`
  naming the key, where its leading dimension doubles with the rows;
- a PRNG key `loss_fn` closes over (or a 0-d key batch leaf, accum.contract):
  every microbatch draws the same numbers. A warning;
- an aux value that is a Python number the rows do not change (a learning rate,
  a config number logged): summed, it comes back multiplied by the number of
  microbatches and devices. A warning naming the key (an array, `jnp.float32(1)`,
  is taken as a count meant to be summed).

One trace of `loss_fn` on the first microbatch's shape (no compute), and a second
on twice its rows (a split that stays divisible by the devices sharding them)
only where a verdict needs it; the warnings are given here, once per trace of the
step, not once per trace of `loss_fn` in the loop. Best effort: a `loss_fn` that
does not trace outside the loop (a collective over a batch axis) is left to the
checks that run inside it (accum.contract, accum.batch_collectives), which judge
none of the above.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
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
_ROWS, _PARAM, _GRAD = "rows", "param", "grad"


def _struct(x: Any, rows: int | None, typed: bool) -> Any:
    """A stand-in for `x` with `rows` rows (0-d leaves as they are); `typed`: with its
    sharding, else a plain shape (one device's view of the same program)."""
    if rows is not None and jnp.ndim(x) == 0:
        return x
    shape = x.shape if rows is None else (rows, *x.shape[1:])
    sharding = getattr(jax.typeof(x), "sharding", None) if typed else None
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)


def _trace(loss_fn: Callable, params: Any, batch: Any, rows: int, rng: tuple, typed: bool) -> Any:
    """(closed jaxpr, output shapes, microbatch stand-in) of `loss_fn` on `rows` rows
    of `batch`, or None where it does not trace here (a collective over a batch axis)."""
    microbatch = jax.tree.map(lambda x: _struct(x, rows, typed), batch)
    if not typed:
        # A model JAX's explicit sharding rules refuse on the global microbatch (stock
        # Flax layers, run on the local path) still traces on plain shapes.
        params = jax.tree.map(
            lambda p: _struct(p, None, False) if hasattr(p, "shape") else p, params
        )
    try:
        return (*jax.make_jaxpr(loss_fn, return_shape=True)(params, microbatch, *rng), microbatch)
    except Exception:  # noqa: BLE001 - best effort: the loop's own checks still run
        return None


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
            labels[out] = found if inexact else found - {_GRAD}
    return labels


def _divisors(jaxpr: Any, var: Any, in_labels: list[frozenset]) -> list:
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
        return _ROWS in label and _GRAD not in label

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
        if eqn is not None and eqn.primitive.name == "div" and scaled_by(eqn) is not None:
            found.append(("const", scale / scaled_by(eqn)[0]))
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
        if _GRAD in label and _ROWS not in label:
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
            other = [v for v in eqn.invars if constant(v) is None]
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
                for v in other:
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
                terms = _divisors(inner, inner.outvars[eqn.outvars.index(var)], inner_labels)
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


class _Traced:
    """One trace of `loss_fn`: its output leaves by path and what `loss_sum` is divided by."""

    def __init__(self, traced: Any, params: Any, microbatch: Any, rng: tuple):
        closed, shapes = traced
        jaxpr = closed.jaxpr
        n_params = len(jax.tree.leaves(params))
        rows = [
            frozenset({_ROWS}) if jnp.ndim(x) > 0 else frozenset()
            for x in jax.tree.leaves(microbatch)
        ]
        in_labels = [
            frozenset({_PARAM, _GRAD})
            if jnp.issubdtype(v.aval.dtype, jnp.inexact)
            else frozenset({_PARAM})
            for v in jaxpr.invars[:n_params]
        ] + rows
        in_labels += [frozenset()] * (len(jaxpr.invars) - len(in_labels))
        self.ok = isinstance(shapes, tuple | list) and len(shapes) == 2
        self.ok = self.ok and isinstance(shapes[1], Mapping) and "weight" in shapes[1]
        if not self.ok or len(in_labels) != len(jaxpr.invars):
            self.ok = False
            return
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
        self.out = dict(
            zip(paths, zip(jaxpr.outvars, jax.tree.leaves(shapes), strict=True), strict=True)
        )
        self.divisors = _divisors(jaxpr, jaxpr.outvars[0], in_labels)

    def aux(self) -> dict:
        """{aux key path: (jaxpr outvar, shape struct)} for the aux leaves."""
        return {p: v for p, v in self.out.items() if p and p[0] == jax.tree_util.SequenceKey(1)}

    def constant(self, path: Any) -> float | None:
        """The value of the output at `path` when the trace fixed it (a Literal)."""
        var = self.out[path][0]
        return float(var.val) if isinstance(var, Literal) and jnp.ndim(var.val) == 0 else None


def _aux_name(path: Any) -> str:
    return "aux" + jax.tree_util.keystr(path[1:])


def check_loss_fn(
    loss_fn: Callable, params: Any, batch: Any, num_microbatches: int, rng: Any
) -> None:
    """Raise (a mean as loss_sum, an aux value with a row per example) or warn (a
    weight that counts nothing, a constant aux value) before the loop; module
    docstring. `batch` the whole step's."""
    leaves = [x for x in jax.tree.leaves(batch) if jnp.ndim(x) > 0]
    if not leaves:
        return
    rows = leaves[0].shape[0] // int(num_microbatches)
    key = () if rng is None else (rng,)
    typed = True
    traced = _trace(loss_fn, params, batch, rows, key, typed)
    if traced is None:
        typed = False
        traced = _trace(loss_fn, params, batch, rows, key, typed)
    if traced is None:
        return
    _check_closed_keys(traced[0])
    full = _Traced(traced[:2], params, traced[2], key)
    if not full.ok:
        return  # the contract's own one-line errors come from the loop (accum.contract)
    weight_path = next((p for p in full.out if p[1:] == (jax.tree_util.DictKey("weight"),)), None)
    if weight_path is None:
        return  # a Mapping whose keys flatten otherwise: nothing to compare
    aux = {p: v for p, v in full.aux().items() if p != weight_path}
    # A row per example: on the leading dimension it asks for the second trace; on a
    # later one (an aux of shape (1, rows)) it is checked where that trace is made
    # anyway (a dimension that merely equals the rows, such as an expert count, would
    # otherwise cost every step a second trace of the model).
    per_row = [p for p, (_, s) in aux.items() if len(s.shape) and s.shape[0] == rows]
    per_row_later = [p for p, (_, s) in aux.items() if rows in s.shape[1:]]
    # Python numbers only (weak-typed): an array constant is taken as a count meant to
    # be summed (the trainer's jnp.float32(terms) per microbatch).
    constants = {
        p: full.constant(p)
        for p, (_, struct) in aux.items()
        if getattr(struct, "weak_type", False) and full.constant(p) is not None
    }
    weight = full.constant(weight_path)
    # A weight fixed at trace time is compared with the doubled rows' one: a Python
    # number (`{"weight": 1}`, `x.shape[0]`) always, an array constant only beside a
    # division, where the second trace is made anyway (so `jnp.float32(rows)` beside
    # a sum, the common idiom, costs no second trace).
    weak = weight not in (None, 0) and getattr(full.out[weight_path][1], "weak_type", False)
    compared = weight is not None and (bool(full.divisors) or weak)
    more = None
    wanted = any(kind in ("const", "param") for kind, _ in full.divisors)
    # The second trace only where a verdict needs it.
    if wanted or per_row or constants or compared:
        traced_more = _trace(loss_fn, params, batch, 2 * rows, key, typed)
        more = None if traced_more is None else _Traced(traced_more[:2], params, batch, key)
        more = more if more is not None and more.ok and more.out.keys() == full.out.keys() else None
    counts = weight is None or (more is not None and more.constant(weight_path) != weight)
    if not counts and more is not None:
        _warn_weight(weight, rows)  # a mean beside it is then not refused: warned about
    _check_mean(full, more, rows, counts)
    _check_parameter_terms(full, more, counts)
    for path in dict.fromkeys(per_row + per_row_later) if more is not None else ():
        shape, doubled = full.out[path][1].shape, more.out[path][1].shape
        if len(shape) == len(doubled) and any(
            d == rows and e == 2 * rows for d, e in zip(shape, doubled, strict=True)
        ):
            raise ValueError(
                f"accum: loss_fn's {_aux_name(path)} has shape {tuple(shape)}, "
                f"a row per example of the microbatch's {rows}; accum sums every aux value over "
                "microbatches and devices, which adds different examples' values together: "
                "return its sum over the rows, or compute per-example outputs outside accum"
            )
    for path, value in constants.items() if more is not None else ():
        if more.constant(path) == value:
            warnings.warn(
                f"accum: loss_fn's {_aux_name(path)} is the constant {value:g} for any rows; "
                "accum sums every aux value over microbatches and devices, so it comes back "
                "multiplied by their number: report it outside loss_fn, return it times "
                "aux['weight'] and divide by the summed weight, or, where that count is "
                "meant, return it as an array (jnp.float32(v))",
                RuntimeWarning,
                stacklevel=3,
            )


def _warn_weight(weight: float, rows: int) -> None:
    """Warn that aux['weight'] is the same constant for `rows` rows and twice as many
    (a zero weight, a microbatch meant to count nothing, passes)."""
    if weight == 0:
        return
    warnings.warn(
        f"accum: aux['weight'] is {weight:g} for a microbatch's {rows} rows and for twice as "
        "many: a weight that does not count the targets makes the result depend on the "
        "number of microbatches and devices; return loss_sum = the sum of per-target "
        "losses and aux['weight'] = the number of targets (mask.sum(), or "
        "jnp.float32(rows))",
        RuntimeWarning,
        stacklevel=4,  # the caller of accumulate_gradients
    )


def _check_mean(full: _Traced, more: _Traced | None, rows: int, counts: bool) -> None:
    """`ValueError` where loss_sum, or one of the terms it adds, is a mean over the
    microbatch's rows (module docstring)."""
    divisors = [d for d in full.divisors if d[0] != "param"]
    if not counts or not divisors:
        return
    if any(kind == "rows" for kind, _ in divisors):
        what = "a value computed from the batch's rows (a mask's sum, a token count)"
    else:
        # A term divided by a constant that grows with the rows (their number): a mean.
        # One that shrinks with them is a sum-like term (a penalty times the weight);
        # one that stays is a fixed scale (a per-sequence mean, `0.5 * sum`).
        more_divisors = [] if more is None else [d for d in more.divisors if d[0] != "param"]
        if len(more_divisors) != len(divisors):
            return
        pairs = zip(divisors, more_divisors, strict=True)
        grows = [a for (_, a), (_, b) in pairs if abs(b) > abs(a) * (1 + 1e-6)]
        if not grows:
            return
        what = f"the constant {grows[0]:g}, which changes with the microbatch's {rows} rows"
    raise ValueError(
        f"accum: loss_fn's loss_sum is a mean: it is divided by {what}; accum adds loss_sum "
        "over microbatches and devices and divides by the summed aux['weight'] once per step, "
        "so return the sum of the per-target losses (jnp.sum, not jnp.mean; no division) with "
        "aux['weight'] their number"
    )


def _check_parameter_terms(full: _Traced, more: _Traced | None, counts: bool) -> None:
    """`ValueError` where loss_sum adds a term of the parameters alone (no batch value in
    it: `+ 0.5 * jnp.sum(w * w)`) that is not weighted by the rows: accum adds loss_sum
    over microbatches and devices, so the term would count once per microbatch and
    device, where the full batch counts it once. Weighted by a row count fixed at trace
    time (`penalty * jnp.float32(rows)`), its literal multiplier doubles with the rows
    and it passes (a count computed from the batch, `penalty * mask.sum()`, is no term
    of the parameters alone). Under a weight that counts nothing (`{"weight": 1}`,
    warned about) each microbatch's value is averaged, and the term with it: no error."""
    terms = [scale for kind, scale in full.divisors if kind == "param"]
    if not counts or not terms:
        return
    more_terms = None if more is None else [s for k, s in more.divisors if k == "param"]
    if more_terms is None or len(more_terms) != len(terms):
        # No second trace to compare: only a term with no literal multiplier at all is
        # certainly unweighted.
        more_terms = [s if s == 1.0 else s / 2 for s in terms]
    if all(abs(b) < abs(a) * 0.75 for a, b in zip(terms, more_terms, strict=True)):
        return
    raise ValueError(
        "accum: loss_fn's loss_sum adds a term computed from the parameters alone (no batch "
        "value in it, such as an L2 penalty `0.5 * jnp.sum(w * w)`); accum adds loss_sum over "
        "microbatches and devices, so that term would count once per microbatch and device, "
        "where the full batch counts it once: multiply it by aux['weight'] (a per-target "
        "penalty), or apply it outside accum (optax.add_decayed_weights on the gradients)"
    )


def _check_closed_keys(closed: Any) -> None:
    """Warn where `loss_fn` closes over a PRNG key (a typed key among the jaxpr's
    constants): every microbatch then starts from that key and draws the same dropout
    masks, where the full batch draws one per row. An nnx model closed over with its
    `Rngs` does the same. (A legacy uint32 key cannot be told from data.)"""
    keys = [
        v
        for v in closed.jaxpr.constvars
        if jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)
    ]
    if keys:
        warnings.warn(
            f"accum: loss_fn closes over {len(keys)} PRNG key(s) "
            f"({', '.join(str(v.aval) for v in keys)}); every microbatch starts from the "
            "same key and draws the same random numbers (dropout masks), where the full "
            "batch draws one set for all its rows: pass the key as "
            "accumulate_gradients(rng=...) and take it as loss_fn's third argument",
            RuntimeWarning,
            stacklevel=4,  # the caller of accumulate_gradients
        )
