"""Trace-time analysis: might the backward pass reduce a deferred axis inside the loop?

The verdict is the compiled program's (accum.verdict, `compile_checked`); this
analysis approximates it before anything compiles, so it only warns (inside a
user's own jit) or names the parameters in the compiled verdict's message. On
generated models it is wrong both ways (benchmarks/results/guard_corpus.md).

Checking the gradients' types is not enough. Autodiff types a reduced
parameter's cotangent as unreduced no matter what the model does with it: if
the model reshards the parameter onto an untagged spec, the backward pass
all-reduces the gradient right there (inside the microbatch loop, often inside
the layer loop too) and then converts the fully reduced value back into an
"unreduced" one. Numerics and output types are unchanged; only the traffic
grows.

Reading the forward pass for dropped tags is not right either: a dropped
forward tag costs nothing when the op's transpose already yields an unreduced
cotangent (`table.at[ids].get(out_sharding=...)` reshards the table to an
untagged spec, yet its scatter-add cotangent is converted to unreduced without
any reduction). So the guard judges by effect: it traces one microbatch's
`vjp` and walks the backward equations (through jit, scan, while, cond,
shard_map, remat and custom_vjp/jvp calls), flagging every equation that turns
a cotangent which is partial over a deferred axis (unreduced over it, sharded
on a contracted dimension, or varying over it inside shard_map) into a value
that is no longer unreduced over it. That is exactly a reduction XLA must run
inside the loop. Each flagged equation is attributed to the parameters whose
gradient it flows into; the cheap forward walk (a layout op that drops a
parameter's `reduced` tag) only adds the line where the tag was lost.

Two rules follow the compiled verdict's: a sum into at most `MAX_ELEMENTS`
elements per device (a loss, a count) is let pass, and a forward equation
that sums a value computed from the parameters alone over a deferred axis (a
weight psum'd inside shard_map) is flagged too, blamed on those parameters:
its transpose reduces their gradient once per microbatch. Forward sums of
activations (a psum of them, a Gram matrix over the batch) are the model's own. A scatter-add adds
locally along an axis that shards both its updates and its result (the
transpose of `take_along_axis` on batch-sharded rows).

Where the pieces are: this module traces one microbatch's vjp and reports what
the walk found (`find_dropped_tags`, `report_dropped_tags`); accum.guard_walk the
walk and its labels; accum.jaxpr_types what a variable's type says about the
mesh; accum.jaxpr_regions the nested jaxprs; accum.source_lines the user's lines.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from accum.guard_walk import BATCH, COTANGENT, Site, Walker, param_label
from accum.jaxpr_types import reduced_over
from accum.seed import cotangent_like
from accum.trace_record import active_record


def _loss_sum(out: Any) -> jax.Array:
    """The differentiated output: loss_fn returns (loss_sum, aux) or just loss_sum."""
    return out[0] if isinstance(out, tuple | list) else out


def _vjp_jaxpr(loss_fn: Callable, params: Any, args: tuple) -> Any:
    """The jaxpr of one microbatch's forward and backward pass.

    Inputs: the parameter leaves, the args' leaves, then the seed; outputs:
    the gradient leaves in parameter order. The seed is an input (not the
    literal 1.0 `jax.grad` uses) so backward equations can be told apart from
    forward ones (and from remat's recomputed forward) by depending on it.
    """

    def grads_of(params, args, seed):
        out, vjp = jax.vjp(lambda p: _loss_sum(loss_fn(p, *args)), params)
        (grads,) = vjp(cotangent_like(seed, out))
        return grads

    return jax.make_jaxpr(grads_of)(params, args, jax.ShapeDtypeStruct((), jnp.float32))


def find_dropped_tags(
    loss_fn: Any, params: Any, *args: Any, axes: tuple[str, ...]
) -> dict[str, list[str]]:
    """Parameters whose gradient the backward pass of `loss_fn` reduces over `axes`.

    `params` must already be tagged (reduced over their deferred axes). Traces
    one forward and backward pass of `loss_fn(params, *args)` (no compute) and
    returns `{key path: [what reduces it and where, ...]}`: each backward
    equation that sums a cotangent over a deferred axis (the reduction XLA
    would run once per microbatch), with the forward source line it came
    from, then each forward equation that sums a value computed from the
    parameters alone over one, then the layout ops that dropped the parameter's
    `reduced` tag in the forward pass, if any. Sums into at most
    `MAX_ELEMENTS` elements per device are not reported. Empty when every gradient stays
    unreduced over `axes` until the accumulator (a forward drop whose
    transpose reduces nothing is not reported).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> w2 = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P()))  # 16 elements
    >>> def drops_tag(params, mb):  # resharding w onto P() drops its reduced tag
    ...     return loss_fn(jax.reshard(params["w"], P()), mb)
    >>> found = []
    >>> with jax.set_mesh(mesh):
    ...     _ = jax.eval_shape(
    ...         lambda p, b: found.append(
    ...             accum.find_dropped_tags(
    ...                 drops_tag, accum.tag_reduced(p, ("data",)), b, axes=("data",)
    ...             )
    ...         ),
    ...         {"w": w2},
    ...         batch,
    ...     )
    >>> list(found[0])  # the parameter whose gradient the backward pass reduces per microbatch
    ["['w']"]
    """
    if not axes:
        return {}
    closed = _vjp_jaxpr(loss_fn, params, args)
    jaxpr = closed.jaxpr
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    n_args = len(jaxpr.invars) - len(paths) - 1
    labels = [frozenset({param_label(p)}) for p in paths]
    labels += [frozenset({BATCH})] * n_args + [frozenset({COTANGENT})]
    record = active_record()
    walker = Walker(frozenset(axes), trace_lines=record is not None)
    grad_labels = walker.walk(jaxpr, labels)
    if record is not None:
        # Which source lines each gradient flows through, and the forward tag
        # drops: they name the parameters in the compiled verdict's message.
        for path, out in zip(paths, grad_labels, strict=False):
            lines = {lab[1:] for lab in out if isinstance(lab, tuple) and lab[0] == "line"}
            record.lines.setdefault(path, set()).update(lines)
        for path, drops in walker.drops.items():
            record.dropped.setdefault(path, []).extend(drops)
    found: dict[str, list[str]] = {}
    for path, var, out in zip(paths, jaxpr.invars, grad_labels, strict=False):
        # Only the axes this parameter defers (its own reduced tag): a parameter
        # sharded over a batch axis (experts) is summed over it by design.
        deferred = reduced_over(var)
        sites = sorted(lab.text for lab in out if isinstance(lab, Site) and lab.axes & deferred)
        sites += [site.text for site in walker.forward.get(path, ()) if site.axes & deferred]
        if sites:
            found[path] = sites + [f"tag dropped by {d}" for d in walker.drops.get(path, [])]
    return found


def report_dropped_tags(
    found: dict[str, list[str]], axes: tuple[str, ...], on_tag_lost: str
) -> None:
    """Hand the trace-time analysis's suspects on: to the enclosing
    `accum.compile_checked` (whose compiled verdict decides and names them),
    else a `RuntimeWarning` (never an error: the analysis approximates what XLA
    will do, and only the compiled program knows) unless on_tag_lost="ignore"."""
    if not found:
        return
    record = active_record()
    for name, sites in found.items() if record is not None else ():
        record.suspects.setdefault(name, []).extend(sites)
    # Under compile_checked the compiled verdict decides; a user's own jit gets the warning.
    if (record is not None and record.checked) or on_tag_lost == "ignore":
        return
    lines = [
        f"{len(found)} parameter(s) may have their gradient (or a value computed from them) "
        f"reduced over {tuple(sorted(axes))} inside loss_fn (once per microbatch instead of "
        "once per step), "
        "by the trace-time analysis, which can be wrong both ways; compile the step with "
        "accum.compile_checked for the exact verdict from the compiled program:"
    ]
    for name, sites in sorted(found.items()):
        lines.extend(f"  {name}: {site}" for site in sites)
    warnings.warn("\n".join(lines), RuntimeWarning, stacklevel=3)
