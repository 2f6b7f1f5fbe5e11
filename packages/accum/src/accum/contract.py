"""The loss contract, checked where a mistake would otherwise surface as a stranger error.

`loss_fn(params, microbatch[, rng]) -> (loss_sum, aux)`: `loss_sum` a scalar, the
*sum* over the microbatch's counted targets, and `aux["weight"]` their number;
accum divides the summed `loss_sum` by the summed `weight` once per step. What
goes wrong otherwise, and what is said instead:

- a batch leaf that is not an array (a Python float), leaves with different
  leading dimensions (a (1, ...) row, a legacy PRNGKey): accum splits every
  leaf's first dimension, so it names the leaf (`check_batch`); a 0-d PRNG key
  (every microbatch draws the same numbers) is warned about;
- a loss without aux, an aux without "weight", a `loss_sum` that is not a scalar
  (per-example losses): one line each, with the shape the user returned for the
  whole microbatch (on the local path the function sees one device's rows; the
  shape is scaled back to the microbatch's) (`checked`).

What only `loss_fn`'s trace shows (a mean as `loss_sum`, a weight that counts
nothing, a per-example aux value) is found once, before the loop, by
accum.contract_probe.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from accum.microbatch import check_rows

CONTRACT = (
    "loss_fn(params, microbatch[, rng]) must return (loss_sum, aux): loss_sum the sum "
    "of the microbatch's per-target losses (a scalar), aux a dict with aux['weight'] the "
    "number of targets counted"
)


def check_batch(batch: Any, num_microbatches: int | None = None) -> None:
    """One line naming the leaf, before any tracing, for a batch leaf accum cannot
    split as the user meant: not an array (`TypeError`), a 0-d PRNG key (a warning:
    every microbatch draws the same numbers), and with `num_microbatches` a
    leading dimension other leaves do not share or that does not divide
    (`ValueError`, accum.microbatch.check_rows)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not hasattr(leaf, "ndim") or not hasattr(leaf, "shape"):
            raise TypeError(
                f"accum: batch leaf {jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__} ({leaf!r}), not an array; accum splits each batch "
                "leaf's first dimension into microbatches: make it jnp.asarray(value) "
                "(a 0-d array goes to every microbatch) or close over it in loss_fn"
            )
        if leaf.ndim == 0 and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            # A 0-d leaf is copied to every microbatch: the same key draws the same
            # dropout masks for each, where the full batch draws one per row. A
            # warning, not an error: the same key everywhere may be what is meant.
            warnings.warn(
                f"accum: batch leaf {jax.tree_util.keystr(path)} is a 0-d PRNG key; it goes "
                "to every microbatch as it is, so each draws the same random numbers (the "
                "full batch draws one set for all its rows): pass it as "
                "accumulate_gradients(rng=...), which folds in the microbatch index",
                RuntimeWarning,
                stacklevel=3,
            )
    if num_microbatches is not None:
        check_rows(batch, num_microbatches)


def check_params(params: Any) -> None:
    """`TypeError`, one line naming the leaf, for a PRNG key among the parameters
    (an nnx model's whole state, `nnx.split(model)`, holds its `Rngs`' keys): a key
    has no gradient and no zeros for one, and JAX's own error names no leaf."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"accum: params leaf {jax.tree_util.keystr(path)} is a PRNG key; differentiate "
                "the trainable state only (nnx: graphdef, params, rest = nnx.split(model, "
                "nnx.Param, ...), merging rest inside loss_fn) and pass a key as rng="
            )


def _shape_text(shape: tuple, rows: int, scale: int) -> str:
    """`shape` as the user wrote it for the whole microbatch: a leading dimension of
    one device's `rows` is scaled by the `scale` devices that split the rows."""
    if scale > 1 and shape and shape[0] == rows:
        shape = (rows * scale, *shape[1:])
    return str(tuple(shape))


def _rows(microbatch: Any) -> int | None:
    """The microbatch's row count (its leaves' leading dimension), if it has rows."""
    sizes = [x.shape[0] for x in jax.tree.leaves(microbatch) if jnp.ndim(x) > 0]
    return sizes[0] if sizes else None


def check_output(out: Any, microbatch: Any, devices: int = 1) -> tuple[Any, Any]:
    """`out` as (loss_sum, aux) if it keeps the contract; else a one-line error.

    `devices`: how many devices split the microbatch's rows where `loss_fn` runs
    (the local path: one device's rows), so a shape is named as the user wrote it.
    """
    if not isinstance(out, tuple | list) or len(out) != 2:
        what = f"a tuple of {len(out)}" if isinstance(out, tuple | list) else _kind(out)
        raise TypeError(f"accum: {CONTRACT}; it returned {what}")
    loss_sum, aux = out
    if not isinstance(aux, Mapping) or "weight" not in aux:
        what = f"keys {sorted(map(str, aux))}" if isinstance(aux, Mapping) else _kind(aux)
        raise KeyError(
            f"loss_fn's aux must hold 'weight' (the number of counted targets); got {what}"
        )
    for path, value in jax.tree_util.tree_flatten_with_path(aux)[0]:
        if not hasattr(value, "dtype") and not isinstance(value, int | float | complex):
            raise TypeError(
                f"accum: loss_fn's aux{jax.tree_util.keystr(path)} is a {type(value).__name__} "
                f"({value!r}); accum sums every aux value over microbatches and devices, so "
                "each must be a number or an array (report other values outside loss_fn)"
            )
    shape = jnp.shape(loss_sum)
    if shape != ():
        rows = _rows(microbatch) or 0
        seen = _shape_text(shape, rows, devices)
        raise ValueError(
            f"accum: loss_fn's loss_sum has shape {seen} for a microbatch of "
            f"{rows * devices} rows; it must be a scalar, the sum over the targets "
            "(jnp.sum(per_example_losses)), with aux['weight'] their number"
        )
    return loss_sum, aux


def _kind(value: Any) -> str:
    """A short description of a returned value: its type, and shape if an array."""
    shape = getattr(value, "shape", None)
    return type(value).__name__ + ("" if shape is None else f" of shape {tuple(shape)}")


def checked(loss_fn: Callable, devices: int = 1) -> Callable:
    """`loss_fn` whose every result is checked by `check_output` (same values)."""

    def loss_with_contract(params: Any, microbatch: Any, *rng: Any) -> tuple[Any, Any]:
        return check_output(loss_fn(params, microbatch, *rng), microbatch, devices)

    return loss_with_contract
