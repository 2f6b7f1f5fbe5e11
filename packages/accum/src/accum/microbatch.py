"""Splitting a batch into microbatches without moving data between devices."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pspec_tags import entry_axes, partitions, spec_of


def _lead_size(batch: Any) -> int:
    """The batch's row count: the leading dimension every leaf with one shares.

    A leaf whose leading dimension differs is named beside the majority's: a
    per-step constant (a (1, ...) broadcast row, a table, a legacy PRNGKey's two
    words) would otherwise be split into microbatches as if it had a row per example.
    """
    rows: dict[int, list[str]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if jnp.ndim(leaf) > 0:
            rows.setdefault(leaf.shape[0], []).append(jax.tree_util.keystr(path))
    if len(rows) > 1:
        common = max(rows, key=lambda size: len(rows[size]))
        odd = ", ".join(
            f"{paths[0]} has {size}" for size, paths in sorted(rows.items()) if size != common
        )
        raise ValueError(
            f"batch leaves disagree on the leading (batch) dimension: {sorted(rows)} "
            f"({rows[common][0]} has {common} rows, {odd}); accum splits every leaf's first "
            "dimension into microbatches: a value with no row per example must be 0-d "
            "(it goes to every microbatch) or closed over in loss_fn"
        )
    return rows.popitem()[0]


def check_rows(batch: Any, num_microbatches: int) -> int:
    """The batch's row count, checked: one leading dimension (`_lead_size`),
    divisible by `num_microbatches`; `ValueError` naming the numbers otherwise."""
    n = int(num_microbatches)
    if n < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not any(jnp.ndim(leaf) > 0 for leaf in jax.tree.leaves(batch)):
        raise ValueError("batch has no array leaves with a batch dimension")
    b = _lead_size(batch)
    if b % n:
        raise ValueError(f"batch size {b} is not divisible by num_microbatches {n}")
    return b


def _axis_product(entry: Any, mesh_shape: dict[str, int]) -> int:
    return math.prod(mesh_shape[a] for a in entry_axes(entry))


def _split_leaf(x: jax.Array, n: int) -> jax.Array:
    """(B, ...) -> (n, B/n, ...), microbatch i holding rows i, i+n, i+2n, ...

    The strided split keeps every row on the device that holds it: with the
    batch dimension sharded, device d owns a contiguous block of rows, and
    reshaping to (B/n, n, ...) leaves that block in the first dimension's shard.
    A contiguous split (rows [i*B/n, (i+1)*B/n)) would need an all-to-all.
    """
    b = x.shape[0]
    spec = spec_of(x)
    if spec is None:  # auto mode: the partitioner follows the reshape on its own
        return jnp.swapaxes(x.reshape(b // n, n, *x.shape[1:]), 0, 1)
    entries = partitions(spec) + (None,) * (x.ndim - len(partitions(spec)))
    mesh = jax.typeof(x).sharding.mesh
    per_device = _axis_product(entries[0], dict(mesh.shape))
    if (b // n) % per_device:
        raise ValueError(
            f"microbatch size {b // n} (batch {b} / num_microbatches {n}) is not divisible "
            f"by the {per_device} devices sharding the batch dimension ({entries[0]!r})"
        )
    # TAG: explicit out_sharding: left alone, reshape may put the batch axes on the
    # microbatch-index dimension instead, which would be a real reshuffle.
    split = NamedSharding(mesh, P(entries[0], None, *entries[1:]))
    y = jnp.reshape(x, (b // n, n, *x.shape[1:]), out_sharding=split)
    return jnp.swapaxes(y, 0, 1)  # a local transpose: the batch axes follow their dimension


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Stack `batch` into `num_microbatches` microbatches along a new leading dimension.

    Every leaf's leading dimension is the batch; `ValueError` names both numbers
    when it does not divide. A 0-d leaf is broadcast: each microbatch gets it.
    Under explicit sharding the split moves no data.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> accum.split_microbatches(batch, 2)["x"].shape
    (2, 8, 8)
    """
    n = int(num_microbatches)
    check_rows(batch, n)
    # A 0-d leaf (a temperature, a step number) has no rows to split: every
    # microbatch gets the same value.
    return jax.tree.map(
        lambda x: jnp.broadcast_to(x, (n,)) if jnp.ndim(x) == 0 else _split_leaf(x, n), batch
    )
