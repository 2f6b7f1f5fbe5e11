"""The local path without a shard_map: one row per batch device, mapped by `jax.vmap`.

On an explicit mesh JAX's shard_map refuses a value `loss_fn` closes over (a
jitted step's traced argument: BatchNorm's running averages read from a
TrainState, a temperature): "Closing over inputs to shard_map where the input
is sharded on Explicit axes is not implemented". accum first passes such a
value in by closure conversion (accum.closure, accum.retype); that cannot
take a closed-over value reaching what accum.retype does not rebuild (a
`custom_vjp`), and this path is where those go (accum.local._local_run).
`jax.vmap` has no such limit (a closed-over value is an unmapped input,
traced where it lives), so this path gets the shard_map's numbers from
explicit types instead of manual axes:

- each batch leaf (B, ...) is reshaped, in place, to (D, B/D, ...) with D the
  number of batch devices and the first dimension sharded over the batch axes:
  row d is device d's own rows, the same rows the shard_map hands it;
- `jax.vmap(value_and_grad(loss_fn), spmd_axis_name=batch axes)` maps the
  weights unmapped (every device reads its whole copy, as in the shard_map) and
  the rows mapped: vmap's gradient of an unmapped input is batched, one
  per-device partial sum per row, with no sum over rows (nothing to reduce);
- the scan adds those rows into a (D, *param) accumulator sharded over the
  batch axes, so each device adds its own row; one sum over the rows after the
  loop is the step's only gradient reduction.

Same rows per microbatch and device as `accum.local` (local rows i, i+n, ...),
the same dropout keys (folded with the microbatch index and the device's
row-major position on the batch axes): the two mechanisms give the same
numbers. Non-batch axes keep their explicit shardings inside the map.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum.device_grads import device_grads, device_key
from accum.plan import ReductionPlan, accumulator_dtype
from accum.verdict import LOOP_SCOPE, marked
from pspec_tags import entry_axes, mesh_axes_used, partitions, spec_of


def batch_devices(plan: ReductionPlan) -> int:
    """The number of batch devices: the product of the batch axes' sizes."""
    return math.prod(dict(plan.mesh_shape)[a] for a in plan.batch_axes)


def _without(spec: P | None, axes: tuple[str, ...], ndim: int) -> tuple:
    """`spec`'s entries (padded to `ndim`) with the batch `axes` taken out."""
    entries = partitions(spec) + (None,) * (ndim - len(partitions(spec)))
    kept = []
    for entry in entries:
        names = tuple(a for a in entry_axes(entry) if a not in axes)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return tuple(kept)


def _on(x: jax.Array, spec: P) -> jax.Array:
    """`x` resharded onto `spec` of its mesh (a no-op when already there)."""
    return jax.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, spec))


def _unsharded_over(params: Any, axes: tuple[str, ...]) -> Any:
    """The weights with the batch axes taken out of their layouts: each device
    reads whole weights (an FSDP weight over a batch axis is gathered once per
    step, before the loop)."""
    return jax.tree.map(lambda p: _on(p, P(*_without(spec_of(p), axes, p.ndim))), params)


def whole_over_batch(params: Any, plan: ReductionPlan) -> Any:
    """On an explicit mesh, each weight sharded over a batch axis gathered over it
    (`_unsharded_over`), the others as they are: the local path's shard_map takes the
    weights whole over the batch axes (in_specs P()), and JAX refuses an explicitly
    sharded argument there rather than gathering it. Gathered once per step, before
    the loop; the step's gradient is placed back on the weight's layout after it (a
    slice). An auto mesh's shard_map gathers by itself."""
    axes = plan.batch_axes
    if plan.mode != "explicit":
        return params

    def whole(p: Any) -> Any:
        return _unsharded_over(p, axes) if set(mesh_axes_used(spec_of(p))) & set(axes) else p

    return jax.tree.map(whole, params)


def device_rows(x: jax.Array, n: int, plan: ReductionPlan) -> jax.Array:
    """A batch leaf (B, ...) -> (n, D, B/(D n), ...): microbatch i, device d
    holding device d's local rows i, i+n, ... (accum.local's split), the device
    dimension sharded over the batch axes. A reshape of each device's own
    block: no data moves. A 0-d leaf is broadcast to (n,)."""
    if x.ndim == 0:
        return jnp.broadcast_to(x, (n,))
    axes, devices = plan.batch_axes, batch_devices(plan)
    rest = _without(spec_of(x), axes, x.ndim)[1:]
    x = _on(x, P(axes, *rest))
    rows = x.shape[0] // devices
    # TAG: out_sharding keeps the batch axes on the device dimension (left to
    # itself the reshape may shard another one: a real reshuffle).
    split = jnp.reshape(
        x, (devices, rows // n, n, *x.shape[1:]), out_sharding=P(axes, None, None, *rest)
    )
    return jnp.moveaxis(split, 2, 0)  # a local transpose: each device keeps its row


def _row_axes(microbatch: Any) -> Any:
    """vmap's in_axes for one microbatch: rows mapped, 0-d leaves unmapped."""
    return jax.tree.map(lambda x: None if jnp.ndim(x) == 0 else 0, microbatch)


def _keys(rng: jax.Array, index: jax.Array, devices: jax.Array) -> jax.Array:
    """One dropout key per device row: `rng` folded with the microbatch `index`
    and the device position, as accum.local folds them."""
    return jax.vmap(lambda d: device_key(rng, index, d))(devices)


def _row_zeros(p: jax.Array, devices: int, axes: tuple, accum_dtype: Any) -> jax.Array:
    """A (D, *p.shape) zero accumulator, rows over the batch axes, in
    `accum_dtype` for floating leaves."""
    dtype = accumulator_dtype(p, accum_dtype)
    spec = P(axes, *_without(spec_of(p), axes, p.ndim))
    return jnp.zeros((devices, *p.shape), dtype, out_sharding=spec)


def mapped_grads(
    loss_fn: Callable, params: Any, microbatch: Any, rng: Any, index: jax.Array, plan
) -> tuple[jax.Array, Any, Any]:
    """(loss sums (D,), aux (D, ...), grads (D, *param)) of one microbatch laid
    out as `device_rows` gives it: row d is device d's rows' partial sums."""
    axes, devices = plan.batch_axes, batch_devices(plan)

    args, in_axes = (params, microbatch), (None, _row_axes(microbatch))
    if rng is not None:
        ids = jnp.arange(devices, dtype=jnp.uint32, out_sharding=P(axes))
        args, in_axes = (*args, _keys(rng, index, ids)), (*in_axes, 0)
    # TAG: the weights unmapped (whole on every device), the rows mapped over the
    # batch axes: vmap's gradient of an unmapped input keeps one row per device.
    one_device = functools.partial(device_grads, loss_fn)
    return jax.vmap(one_device, in_axes=in_axes, spmd_axis_name=axes)(*args)


def _added(acc: Any, grads: Any) -> Any:
    """`acc + grads`, each gradient cast to its accumulator's dtype and laid out
    as it (a gradient no row depends on comes back unsharded: a local slice)."""

    def add(a: jax.Array, g: jax.Array) -> jax.Array:
        return a + _on(g.astype(a.dtype), jax.typeof(a).sharding.spec)

    return jax.tree.map(add, acc, grads)


def mapped_accumulate(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    *,
    num_microbatches: int,
    plan: ReductionPlan,
    rng: jax.Array | None,
    accum_dtype: Any,
) -> tuple[jax.Array, Any, Any]:
    """(loss sum, aux sum, gradient sum) of `batch`, reduced once after the loop;
    the caller normalizes and places them (accum.local)."""
    n, axes, devices = num_microbatches, plan.batch_axes, batch_devices(plan)
    weights = _unsharded_over(params, axes)
    microbatches = jax.tree.map(lambda x: device_rows(x, n, plan), batch)
    acc0 = jax.tree.map(lambda p: _row_zeros(p, devices, axes, accum_dtype), weights)

    def step(acc, xs):
        index, microbatch = xs
        loss_sums, aux, grads = mapped_grads(loss_fn, weights, microbatch, rng, index, plan)
        return _added(acc, grads), (loss_sums, aux)

    indices = jnp.arange(n, dtype=jnp.uint32)
    with marked(LOOP_SCOPE, axes, dict(plan.mesh_shape)):
        acc, (loss_sums, auxes) = lax.scan(step, acc0, (indices, microbatches))
    # The step's one reduction: the devices' rows summed (loss and aux too).
    total = jax.tree.map(lambda a: jnp.sum(a, 0), acc)
    return jnp.sum(loss_sums), jax.tree.map(lambda a: jnp.sum(a, (0, 1)), auxes), total


def mapped_add(
    grads: Any, count: jax.Array, loss_fn: Callable, params: Any, microbatch: Any, rng: Any, plan
) -> tuple[Any, jax.Array, Any]:
    """`accum.add` on the mapped local path: (grads (D, *param) plus this
    microbatch's rows, loss sum, aux sum); the gradients stay in each device's
    row, only the loss and aux are summed."""
    weights = _unsharded_over(params, plan.batch_axes)
    rows = jax.tree.map(lambda x: device_rows(x, 1, plan)[0], microbatch)
    loss_sums, aux, new = mapped_grads(loss_fn, weights, rows, rng, count, plan)
    return _added(grads, new), jnp.sum(loss_sums), jax.tree.map(lambda a: jnp.sum(a, 0), aux)
