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

from accum.loss_terms import GRAD, PARAM, ROWS, divisors


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


class _Traced:
    """One trace of `loss_fn`: its output leaves by path and what `loss_sum` is divided by."""

    def __init__(self, traced: Any, params: Any, microbatch: Any, rng: tuple):
        closed, shapes = traced
        jaxpr = closed.jaxpr
        n_params = len(jax.tree.leaves(params))
        rows = [
            frozenset({ROWS}) if jnp.ndim(x) > 0 else frozenset()
            for x in jax.tree.leaves(microbatch)
        ]
        in_labels = [
            frozenset({PARAM, GRAD})
            if jnp.issubdtype(v.aval.dtype, jnp.inexact)
            else frozenset({PARAM})
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
        self.divisors = divisors(jaxpr, jaxpr.outvars[0], in_labels)

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
    means = [d for d in full.divisors if d[0] != "param"]
    if not counts or not means:
        return
    if any(kind == "rows" for kind, _ in means):
        what = "a value computed from the batch's rows (a mask's sum, a token count)"
    else:
        # A term divided by a constant that grows with the rows (their number): a mean.
        # One that shrinks with them is a sum-like term (a penalty times the weight);
        # one that stays is a fixed scale (a per-sequence mean, `0.5 * sum`).
        more_means = [] if more is None else [d for d in more.divisors if d[0] != "param"]
        if len(more_means) != len(means):
            return
        pairs = zip(means, more_means, strict=True)
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
        unweighted = [a for a in terms if a == 1.0]
    else:
        # Weighted by the rows, its divisor halves as they double.
        pairs = zip(terms, more_terms, strict=True)
        unweighted = [a for a, b in pairs if abs(b) >= abs(a) * 0.75]
    if not unweighted:
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
