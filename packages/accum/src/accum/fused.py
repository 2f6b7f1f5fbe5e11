"""Gradient accumulation fused into the backward pass of a scanned layer stack.

`scan_layers(body, carry, stacked)` is `lax.scan` over a stack of layers.
Inside `accumulate_gradients(..., schedule="fused")` (or `add(...,
schedule="fused")`), each stacked parameter's gradient is added into its
accumulator's slice *inside* the backward layer scan, as each layer's gradient
is produced: no full-size per-microbatch gradient exists beside the accumulator
(Megatron's gradient-accumulation fusion). On the step's last microbatch (the
overlapped schedules), each layer's final sum is reduced there instead —
all-reduce, or reduce-scatter onto ZeRO-1 shards — pipelined by one layer:
iteration l reduces layer l+1's total (finished in the previous iteration)
while it computes layer l's backward, so nothing in the iteration waits for
that collective and it can run under all of it.

How: the stack is a `custom_vjp` whose forward is the plain scan (saving each
layer's VJP residuals) and whose backward is a reverse scan that carries the
accumulator and updates it in place. The new accumulator leaves the backward
pass as the cotangent of a *sink*: a dummy zero input whose cotangent type is
the accumulator's (a `reduced` sink for an `unreduced` accumulator, since
autodiff maps reduced primals to unreduced cotangents). A *probe* on each
parameter sees, with symbolic zeros, whether the parameter also reached the
loss outside `scan_layers` (weight decay, tied weights), so that gradient is
added the ordinary way instead of being lost.

Outside an accumulation context `scan_layers` is exactly `lax.scan`.

Where the pieces are: accum.sink_leaf the per-leaf entry (`SinkLeaf`); this
module the context (`sinks_active`), `scan_layers`, the probe and sink, and
`fused_value_and_grad`; accum.fused_scan the custom_vjp stack and its backward
scan; accum.overlapped the last microbatch's per-layer reductions;
accum.layer_slices the per-device reads and writes of one layer's slice.

Why the context is not passed explicitly: `scan_layers` is called from inside
the caller's `loss_fn` (the model), whose signature accum does not own. The only
values that cross from `accumulate_gradients` into it are the parameter and
argument pytrees, and `jax.value_and_grad` replaces every leaf by a JAX tracer.
A tracer cannot carry the entry (`jax.core.Tracer` has `__slots__`, so no
attribute can be set on it), and an extra pytree leaf or argument would change
the model's code. So `sinks_active` publishes, for the duration of the trace,
a map from the `id` of each parameter tracer accum hands in (its probe's
output) to its entry, and `scan_layers` looks up the very leaves the model
passes it (the model indexes its parameter tree; it does not copy the arrays;
a leaf it transforms first is not found and takes the ordinary path through
its probe).

The map lives in a thread-local because JAX's own trace state is per thread:
two threads tracing at once each see only their own entries.

Why a claim needs `loss_fn`'s own trace: the stack's backward returns the running
accumulator plus this microbatch's gradient as the sink's cotangent, and autodiff
sums a cotangent over every time the backward runs. That must be exactly once. A
`scan_layers` call inside `jax.vmap`, `lax.map`/`scan`/`while_loop`, `lax.cond`,
`jax.checkpoint` or an inner `jit` is traced in a trace of its own, and there the
backward may run once per lane or iteration (the accumulator counted that many
times), or not at all (a branch not taken: the accumulator lost). Such a call is
not claimed (a warning says so): its gradient reaches the probe and is added after
the backward pass, as under the plain schedule. A claimed call whose backward
never runs (its output under `stop_gradient`, or unused) leaves the sink's
cotangent a symbolic zero, which the sink's own probe sees; the leaf is then
added the ordinary way too.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import get_opaque_trace_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum.fused_scan import fused_scan
from accum.layer_slices import leading_unsharded
from accum.seed import value_and_grad as seeded_value_and_grad
from accum.sink_leaf import SinkLeaf
from pspec_tags import partitions, spec_of, unreduced_axes

_STATE = threading.local()


@contextlib.contextmanager
def sinks_active(by_id: dict[int, SinkLeaf]):
    """Within this context, `scan_layers` fuses the leaves whose `id` is in `by_id`."""
    stack = getattr(_STATE, "stack", [])
    _STATE.stack = [*stack, by_id]
    try:
        yield
    finally:
        _STATE.stack = stack


def _active() -> dict[int, SinkLeaf] | None:
    stack = getattr(_STATE, "stack", [])
    return stack[-1] if stack else None


def scan_layers(body: Callable, carry: Any, stacked: Any) -> tuple[Any, Any]:
    """`lax.scan(body, carry, stacked)` over a layer stack, fused with gradient accumulation.

    `body(carry, layer) -> (carry, y)`; `stacked` holds the layers' parameters on
    a leading axis. Outside a fused schedule of `accumulate_gradients` this is
    `lax.scan`. Inside, every stacked parameter leaf accum accumulates (and
    whose layer axis is not sharded) has its gradient added into its
    accumulator slice inside the backward scan. `body` may close over other
    values (positions, masks, shared weights): their gradients flow as usual.

    >>> import jax, jax.numpy as jnp
    >>> from accum import scan_layers
    >>> w_LxDxD = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> x_D, ys = scan_layers(lambda x, w: (x @ w, x.sum()), jnp.ones(2), w_LxDxD)
    >>> x_D.tolist(), ys.tolist()
    ([2.0, 2.0], [2.0, 2.0])
    """
    by_id = _active()
    leaves, tree = jax.tree.flatten(stacked)
    entries = [None] * len(leaves)
    nested = []
    if by_id is not None:
        for k, leaf in enumerate(leaves):
            entry = by_id.get(id(leaf))
            # A second use of the same stack is an ordinary use (its gradient
            # reaches the probe and is added by accum); a sharded layer axis
            # cannot be sliced in place.
            if entry is None or entry.claimed or not leading_unsharded(spec_of(leaf)):
                continue
            # Inside a transformation of loss_fn the backward may run other than
            # once (module docstring): an ordinary use, added after the pass.
            if entry.trace != _trace_state():
                nested.append(entry)
                continue
            entry.claimed = True
            entries[k] = entry
    if nested:
        _warn_nested()
    if not any(entries):
        return lax.scan(body, carry, stacked)
    return fused_scan(body, carry, leaves, tree, entries)


def _trace_state() -> Any:
    """The current JAX trace, comparable with ==."""
    return get_opaque_trace_state(convention="accum")


def _warn_nested() -> None:
    warnings.warn(
        "accum.scan_layers runs inside a JAX transformation of loss_fn (vmap, "
        "lax.map/scan/while_loop, cond, checkpoint or an inner jit), where its backward "
        "may run other than once per microbatch: its stacked parameters' gradients are "
        "added after the backward pass (as under schedule='plain'), not inside it. Call "
        "scan_layers in loss_fn itself to fuse them",
        RuntimeWarning,
        stacklevel=3,
    )


def _probe(x: Any, entry: SinkLeaf, flag: str) -> Any:
    """Identity whose backward sets `entry.<flag>` (at trace time) where `x`'s
    cotangent is not a symbolic zero. On a parameter (`used_elsewhere`): a use
    outside `scan_layers`. On a sink (`sink_ran`): the claimed stack's backward
    returned the accumulator, which it does not where it never runs (the stack's
    output unused, or under stop_gradient)."""

    @jax.custom_vjp
    def probe(value):
        return value

    def probe_fwd(value):
        return value.value, None

    def probe_bwd(_, ct):
        if isinstance(ct, jax.custom_derivatives.SymbolicZero):
            return (None,)
        setattr(entry, flag, True)
        return (ct,)

    probe.defvjp(probe_fwd, probe_bwd, symbolic_zeros=True)
    return probe(x)


def sink_type(acc: jax.Array, final_spec: P | None) -> Any:
    """Zeros whose cotangent type is the result's: `final_spec` (untagged) when
    reducing, else the accumulator's own type, via a `reduced` tag where it is
    `unreduced` (autodiff pairs the two)."""
    spec = spec_of(acc)
    if final_spec is not None:
        target = final_spec
    elif spec is None:
        return jnp.zeros(acc.shape, acc.dtype)
    else:
        # TAG: reduced over exactly the accumulator's unreduced axes, so the
        # sink's cotangent is typed like the accumulator (no reshard on return).
        target = P(*partitions(spec), reduced=unreduced_axes(spec))
    mesh = jax.typeof(acc).sharding.mesh
    return lax.broadcast_in_dim(
        jnp.zeros((), acc.dtype), acc.shape, (), out_sharding=NamedSharding(mesh, target)
    )


def fused_value_and_grad(
    loss_fn: Callable,
    params: Any,
    args: tuple,
    entry_leaves: list,
) -> tuple[tuple[jax.Array, dict], Any, list]:
    """`((loss_sum, aux), grads, sink_results)` with `entry_leaves` (a SinkLeaf or
    None per parameter leaf, flattened) offered to `scan_layers` inside `loss_fn`.

    For a claimed leaf, `sink_results` holds the new accumulator (or the reduced
    gradient) and `grads` its gradient from other uses (valid only when the
    entry's `used_elsewhere` is set); other leaves' `grads` are as usual.
    """
    treedef = jax.tree.structure(params)
    param_leaves = treedef.flatten_up_to(params)
    sinks = [None if e is None else e.sink for e in entry_leaves]

    def loss_with_sinks(param_leaves_, sinks_):
        by_id = {}
        probed = []
        for p, e, s in zip(param_leaves_, entry_leaves, sinks_, strict=True):
            if e is not None:
                p = _probe(p, e, "used_elsewhere")
                e.sink = _probe(s, e, "sink_ran")
                e.trace = _trace_state()
                by_id[id(p)] = e
            probed.append(p)
        with sinks_active(by_id):
            return loss_fn(jax.tree.unflatten(treedef, probed), *args)

    (loss_sum, aux), (grad_leaves, sink_cts) = seeded_value_and_grad(
        loss_with_sinks, argnums=(0, 1)
    )(param_leaves, sinks)
    for e, s in zip(entry_leaves, sinks, strict=True):
        if e is not None:
            e.sink = s
    return (loss_sum, aux), jax.tree.unflatten(treedef, grad_leaves), sink_cts
