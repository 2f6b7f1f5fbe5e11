"""The local path: each microbatch's loss and gradient inside a `shard_map` over the batch axes.

Where tags cannot flow (a primitive without a `reduced` sharding rule, a
library that unpacks a tagged PartitionSpec, an elementwise op between a
batch-sharded activation and a reduced bias, or an auto mesh whose types hold
no shardings at all), the same deferral is had by hand: inside a `shard_map`
that makes only the batch axes manual, every device holds the whole weights
(replicated over those axes) and its own rows of each microbatch. Each device
differentiates its rows' loss with respect to a *varying* copy of the weights
(`pcast(..., to="varying")`), so autodiff has nothing to sum across devices:
its gradient is the device's local partial sum. The scan adds those up, and
one `psum` after the loop is the step's only gradient reduction. Any model runs
unchanged inside; axes that are not batch axes stay as they are (explicit or
auto), so a model axis keeps its sharding.

Closures: on an auto mesh JAX passes a value `loss_fn` closes over (a jitted
step's argument: BatchNorm's running averages, a traced temperature) into the
shard_map, replicated. On an explicit mesh JAX refuses it ("Closing over inputs
to shard_map ... not implemented") at the first op that reads it, and nothing
outside `loss_fn` can hand it in (it sits in the Python closure). There
`_local_run` tries, in order:

- closure conversion (accum.closure): `loss_fn` traced once outside the
  shard_map, the closed-over arrays made arguments the shard_map takes
  replicated, the jaxpr evaluated inside: the same shard_map, rows, keys and
  numbers. Where a closed-over value reaches a nested jaxpr (`jax.nn.relu`/
  `softmax` of it, a `jit`, `scan`, `cond`, `checkpoint`, a closed-over dropout
  key reaching `jax.random`'s jitted samplers), whose types the outer trace
  fixed, accum.retype traces that jaxpr again inside; what it does not rebuild
  (a `custom_vjp` the value reaches) fails here;
- the same accumulation without a shard_map (accum.local_mapped: `jax.vmap`
  over one row per batch device, same rows, keys and numbers), which takes
  any closure but not a layer JAX's explicit sharding rules cannot map over
  the device rows (`Embed`'s gather, `Conv`'s batching reshape);
- failing both, one line saying what to do.

What differs from the full batch: a value the model computes over the batch
dimension (a batch norm's statistics, a contrastive loss's negatives) sees the
device's rows of the microbatch, as under `pmap` or DDP. Dropout keys are
folded with the microbatch index and the device's position on the batch axes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from accum.batch_collectives import check_lifted
from accum.closure import lift_closure
from accum.device_grads import device_grads, device_key
from accum.jaxpr_types import manual_axes
from accum.local_mapped import batch_devices, mapped_accumulate, mapped_add, whole_over_batch
from accum.plan import ReductionPlan, accumulator_dtype, is_floating
from accum.tags import reduce_to, safe_inverse
from accum.trace_record import record_params, traced
from accum.verdict import ADD_SCOPE, LOOP_SCOPE, marked


def _local_split(x: jax.Array, n: int) -> jax.Array:
    """A device's rows (b, ...) -> (n, b/n, ...), microbatch i holding local rows
    i, i+n, ...: the same rows as the strided split of the global batch."""
    if x.ndim == 0:
        return jnp.broadcast_to(x, (n,))
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def _device_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's position along the batch axes (row-major), inside shard_map."""
    index = jnp.zeros((), jnp.uint32)
    for axis in axes:
        index = index * lax.axis_size(axis) + lax.axis_index(axis).astype(jnp.uint32)
    return index


def _varying(params: Any, axes: tuple[str, ...]) -> Any:
    """A varying copy of the (replicated) weights inside the shard_map: the
    gradient of each device's loss with respect to it stays that device's
    partial sum (autodiff adds no psum)."""
    return jax.tree.map(lambda p: lax.pcast(p, axes, to="varying"), params)


def _varying_sums(tree: Any, axes: tuple[str, ...]) -> Any:
    """`tree` made fit for the step's psum over `axes`: a value varying over some
    of them but not all (a sync BatchNorm's statistics on a data x model mesh,
    averaged over "data" by `loss_fn`) is typed varying over the rest, so it is
    counted once per device as a value the same on every device already is
    (JAX's psum of an invariant value; the rows-weighted sum divided by the
    weight gives it back). Values varying over all or none stay as they are."""

    def one(x: jax.Array) -> jax.Array:
        have = manual_axes(x, "varying")
        missing = tuple(a for a in axes if a not in have)
        return lax.pcast(x, missing, to="varying") if have and missing else x

    return jax.tree.map(one, tree)


def _zeros(p: jax.Array, accum_dtype: Any) -> jax.Array:
    """A zero accumulator like `p`, in `accum_dtype` for floating leaves (complex
    ones keep their imaginary part: accum.plan.accumulator_dtype)."""
    return jnp.zeros_like(p, accumulator_dtype(p, accum_dtype))


_CLOSURE = "Closing over inputs to shard_map"


_MESH_MISMATCH = re.compile(r"context mesh .*Manual.* should match the aval mesh .*for shape (\S+)")


def _closure_refused(error: Exception) -> str | None:
    """The closed-over value's type when `error` is JAX refusing a closure over
    an explicit-mesh value inside the shard_map, else None: the
    NotImplementedError where every other axis is auto, the mesh-mismatch
    ValueError where one is explicit (a data x model mesh)."""
    text = str(error)
    if isinstance(error, NotImplementedError) and _CLOSURE in text:
        return text.rsplit("Got input with shape ", 1)[-1].split("\n")[0]
    found = _MESH_MISMATCH.search(text) if isinstance(error, ValueError) else None
    return None if found is None else found.group(1)


def _direct(loss_fn: Callable) -> Callable:
    """`loss_fn` in the converted signature `fn(consts, *args)`, taking no consts."""
    return lambda consts, *args: loss_fn(*args)


def _sharding_refusal(error: Exception) -> bool:
    """Whether `error` is JAX's explicit sharding rules refusing an op."""
    return type(error).__name__ == "ShardingTypeError" or isinstance(error, NotImplementedError)


def shortened(text: str, limit: int = 200) -> str:
    """`text` cut to at most `limit` characters at a word's end, " ..." marking a cut."""
    if len(text) <= limit:
        return text
    return text[: text.rfind(" ", 0, limit - 4) + 1 or limit - 4].rstrip() + " ..."


def _first_line(error: Exception) -> str:
    """`error`'s type and the first line of its message, for a one-line report."""
    return f"{type(error).__name__}: {shortened((str(error).strip().splitlines() or [''])[0])}"


def _local_run(
    run: Callable, loss_fn: Callable, local_args: tuple, mapped: Callable, plan: ReductionPlan
) -> Any:
    """The local path's mechanism for `loss_fn` (module docstring), first that works:

    1. `run(fn, consts, check_vma)`, the shard_map (`fn(consts, params, rows,
       *key)` the loss), on `loss_fn` itself;
    2. where JAX refuses a closed-over value in it, on `loss_fn` closure-converted
       (accum.closure), traced on `local_args` (one device's params, rows, key);
    3. where that fails (a closed-over value reaching a custom_vjp), `mapped()`
       (accum.local_mapped, jax.vmap over the device rows);
    4. where that fails on a sharding rule too, a one-line error naming the fix.
    """
    try:
        return run(_direct(loss_fn), (), True)
    except (NotImplementedError, ValueError) as error:
        got = _closure_refused(error)
        if got is None:
            raise
    axes = plan.batch_axes
    try:
        # The batch axes bound, so a sync BatchNorm's pmean over them traces.
        env = tuple((a, dict(plan.mesh_shape)[a]) for a in axes)
        converted, consts = lift_closure(loss_fn, *local_args, axis_env=env)
    except Exception as error:  # noqa: BLE001 - the mapped mechanism decides, below
        converted, not_converted = None, error
    if converted is not None:
        # Traced outside the shard_map, the jaxpr has no varying types (accum.closure):
        # a loss reduced over a batch axis is found on the jaxpr instead.
        check_lifted(converted.jaxpr, converted.out_shape, axes)
        try:
            return run(converted, consts, False)
        except Exception as error:  # noqa: BLE001 - the mapped mechanism decides, below
            not_converted = error
    try:
        return mapped()
    except Exception as error:  # noqa: BLE001 - only JAX's sharding refusals, below
        if isinstance(error, NameError) and "unbound axis name" in str(error):
            raise ValueError(
                f"accum local path: loss_fn runs a collective over a batch axis {axes} "
                f"and closes over an array on an explicit mesh ({got}); closure conversion "
                f"failed ({_first_line(not_converted)}) and jax.vmap binds no batch axis: "
                "pass the closed-over array through the params or the batch"
            ) from error
        if not _sharding_refusal(error):
            raise
        raise ValueError(
            f"accum local path: loss_fn closes over an array on an explicit mesh ({got}), "
            "which JAX's shard_map refuses; passing it in by closure conversion failed "
            f"({_first_line(not_converted)}), and so did mapping each device's rows with "
            f"jax.vmap ({_first_line(error)}): pass it through the params or the batch "
            "(examples/flax/batchnorm.py), or use an auto mesh"
        ) from error


def _normalized(loss_sum: jax.Array, aux: dict, grads: Any) -> tuple[jax.Array, dict, Any]:
    """(mean loss, summed aux, mean gradients): the sums divided by aux["weight"]."""
    inv = safe_inverse(aux["weight"])
    grads = jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)
    return loss_sum * inv.astype(loss_sum.dtype), aux, grads


def _device_grads(loss_fn, varying, microbatch, rng, index, device, axes) -> tuple:
    """(loss_sum, aux, grads) of this device's rows of one microbatch; dropout
    keys folded with the microbatch `index` and the `device`; a loss reduced over
    the batch `axes` inside `loss_fn` refused (accum.batch_collectives)."""
    key = () if rng is None else (device_key(rng, index, device),)
    return device_grads(loss_fn, varying, microbatch, *key, axes=axes)


def local_accumulate(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    *,
    num_microbatches: int,
    plan: ReductionPlan,
    rng: jax.Array | None,
    grad_shardings: Any,
    accum_dtype: Any,
) -> tuple[jax.Array, dict, Any]:
    """`accumulate_gradients` on the local path (module docstring); same result."""
    axes = plan.batch_axes
    params = whole_over_batch(params, plan)
    n = num_microbatches
    batch_spec = _batch_specs(batch, axes)

    def body(fn, params, batch, consts, *maybe_rng):
        rng = maybe_rng[0] if maybe_rng else None
        loss_fn = functools.partial(fn, consts)
        microbatches = jax.tree.map(lambda x: _local_split(x, n), batch)
        # TAG: a varying copy of the weights: the gradient of each device's loss
        # with respect to it stays that device's partial sum (no psum in the loop).
        varying = _varying(params, axes)
        acc0 = jax.tree.map(lambda p: _zeros(p, accum_dtype), varying)
        device = _device_index(axes)

        def step(acc, xs):
            index, microbatch = xs
            loss_sum, aux, grads = _device_grads(
                loss_fn, varying, microbatch, rng, index, device, axes
            )
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
            return acc, (loss_sum, aux)

        indices = jnp.arange(n, dtype=jnp.uint32)
        with marked(LOOP_SCOPE, axes, dict(plan.mesh_shape)):
            acc, (loss_sums, auxes) = lax.scan(step, acc0, (indices, microbatches))
        # The step's one reduction of the gradients, loss and aux.
        sums = (jnp.sum(loss_sums, 0), jax.tree.map(lambda a: jnp.sum(a, 0), auxes), acc)
        return lax.psum(_varying_sums(sums, axes), axes)

    def run(fn, consts, check_vma):
        args = (params, batch, consts) if rng is None else (params, batch, consts, rng)
        # TAG: weights, closed-over arrays and key replicated, the batch's rows per device.
        specs = (P(), batch_spec, P(), P())[: len(args)]
        return jax.shard_map(
            functools.partial(body, fn),
            in_specs=specs,
            out_specs=P(),
            axis_names=set(axes),
            check_vma=check_vma,
        )(*args)

    def mapped():
        return mapped_accumulate(
            loss_fn, params, batch, num_microbatches=n, plan=plan, rng=rng, accum_dtype=accum_dtype
        )

    rows = jax.tree.map(lambda x: _device_rows(x, batch_devices(plan) * n), batch)
    with traced(plan):
        record_params(params)
        sums = _local_run(run, loss_fn, _local_args(params, rows, rng), mapped, plan)
    loss, aux, grads = _normalized(*sums)
    return loss, aux, _placed(_own_dtypes(grads, params), plan, grad_shardings)


def _own_dtypes(grads: Any, params: Any) -> Any:
    """Each non-floating leaf's "gradient" as zeros of its own dtype, as on the tags
    path: the step's psum turns a bool leaf's zeros into int32, and an optimizer's
    update would then turn the bool parameter (a flag, a mask) into an int32 one."""
    return jax.tree.map(lambda g, p: g if is_floating(p) else jnp.zeros_like(p), grads, params)


def _placed(grads: Any, plan: ReductionPlan, grad_shardings: Any) -> Any:
    """Reduced gradients on `grad_shardings`, by default (explicit mode) each on
    its parameter's own layout: a batch-sharded parameter was gathered at the
    shard_map's entry, so this is a slice, no reduction."""
    if grad_shardings is None and plan.mode == "explicit":
        grad_shardings = plan.map(lambda leaf: leaf.param_spec)
    return grads if grad_shardings is None else reduce_to(grads, grad_shardings, plan.mode)


# ------------------------------------------------- start / add / finish (accum.dispatch)
#
# Between dispatches each device's partial sums live in one global array per
# parameter with a leading device dimension, sharded over the batch axes (each
# device holds its own row): `add` adds into its row locally, `finish` sums the
# rows, the one reduction.


def _batch_specs(tree: Any, axes: tuple[str, ...]) -> Any:
    """Each leaf's rows over `axes` (0-d leaves replicated)."""
    return jax.tree.map(lambda x: P() if jnp.ndim(x) == 0 else P(axes), tree)


def _device_rows(x: jax.Array, parts: int) -> jax.ShapeDtypeStruct:
    """The shape of one of `parts` row blocks of a batch leaf (0-d: itself)."""
    shape = x.shape if x.ndim == 0 else (x.shape[0] // parts, *x.shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype)


def _local_args(params: Any, rows: Any, rng: Any) -> tuple:
    """What `loss_fn` is called with inside the shard_map, for the trace that
    closure-converts it: the weights, one device's rows, its key (same shape
    as `rng`: `device_key` folds it)."""
    return (params, rows) if rng is None else (params, rows, rng)


def local_zeros(params: Any, plan: ReductionPlan, accum_dtype: Any) -> Any:
    """`start`'s accumulator on the local path: zeros of shape (devices, *param)."""
    axes = plan.batch_axes
    params = whole_over_batch(params, plan)

    def body(params):
        return jax.tree.map(lambda p: _zeros(p, accum_dtype)[None], _varying(params, axes))

    return jax.shard_map(body, in_specs=P(), out_specs=P(axes), axis_names=set(axes))(params)


def local_add(
    grads: Any, count: jax.Array, loss_fn: Callable, params: Any, microbatch: Any, rng: Any, plan
) -> tuple[Any, jax.Array, Any]:
    """`add` on the local path: (grads plus this microbatch's, loss sum, aux sum).
    Gradients stay in each device's row; the loss and aux (scalars) are summed."""
    axes = plan.batch_axes
    params = whole_over_batch(params, plan)

    def body(fn, grads, params, microbatch, count, consts, *maybe_rng):
        rng = maybe_rng[0] if maybe_rng else None
        loss_sum, aux, new = _device_grads(
            functools.partial(fn, consts),
            _varying(params, axes),
            microbatch,
            rng,
            count,
            _device_index(axes),
            axes,
        )
        grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype)[None], grads, new)
        return grads, *lax.psum((loss_sum, aux), axes)

    def run(fn, consts, check_vma):
        args = (grads, params, microbatch, count, consts, *(() if rng is None else (rng,)))
        specs = (P(axes), P(), _batch_specs(microbatch, axes), P(), P(), P())[: len(args)]
        return jax.shard_map(
            functools.partial(body, fn),
            in_specs=specs,
            out_specs=(P(axes), P(), P()),
            axis_names=set(axes),
            check_vma=check_vma,
        )(*args)

    rows = jax.tree.map(lambda x: _device_rows(x, batch_devices(plan)), microbatch)
    with traced(plan, "add"), marked(ADD_SCOPE, axes, dict(plan.mesh_shape)):
        record_params(params)
        return _local_run(
            run,
            loss_fn,
            _local_args(params, rows, rng),
            lambda: mapped_add(grads, count, loss_fn, params, microbatch, rng, plan),
            plan,
        )


def local_finish(grads: Any, plan: ReductionPlan, grad_shardings: Any) -> Any:
    """`finish`'s one reduction on the local path: the devices' rows summed,
    then each gradient on `grad_shardings` (default: its parameter's layout)."""
    axes = plan.batch_axes
    summed = jax.shard_map(
        lambda g: lax.psum(jax.tree.map(lambda x: x[0], g), axes),
        in_specs=P(axes),
        out_specs=P(),
        axis_names=set(axes),
    )(grads)
    return _placed(summed, plan, grad_shardings)
