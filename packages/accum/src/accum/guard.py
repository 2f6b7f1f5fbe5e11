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
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from accum.seed import cotangent_like
from accum.trace_record import active_record
from accum.verdict import MAX_ELEMENTS
from pspec_tags import (
    entry_axes,
    mesh_axes_used,
    partitions,
    reduced_axes,
    unreduced_axes,
)

# Primitives that change only a value's layout: passing a reduced value through
# one of them onto an untagged spec is the forward-side drop.
_LAYOUT_PRIMITIVES = frozenset({"reshard", "mesh_cast", "sharding_constraint", "device_put"})
# Explicit-mode contractions: they reduce the mesh axes sharding a summed dim.
_REDUCE_PRIMITIVES = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
_SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})
# Collectives inside shard_map that sum (or otherwise combine) varying blocks
# over manual axes. Gathers (all_gather, all_to_all, ppermute) move data only.
_MANUAL_REDUCTIONS = frozenset(
    {
        "psum",
        "psum2",
        "psum_invariant",
        "pmax",
        "pmin",
        "reduce_scatter",
        "psum_scatter",
        "unreduced_psum",
        "unreduced_reduce_scatter",
    }
)


# ---------------------------------------------------------------- labels


@dataclasses.dataclass(frozen=True)
class _Site:
    """One backward equation that reduces deferred `axes`."""

    text: str
    axes: frozenset[str]


_COTANGENT = "<cotangent>"  # label: the value depends on the backward seed
_BATCH = "<batch>"  # label: the value depends on the microbatch (an activation)


def _param(path: str) -> tuple[str, str]:
    return ("param", path)


def _params_in(labels: Iterable) -> list[str]:
    return sorted(lab[1] for lab in labels if isinstance(lab, tuple) and lab[0] == "param")


# ---------------------------------------------------------------- avals


def _aval(var: Any) -> Any:
    return getattr(var, "aval", None)


def _spec(var: Any) -> P | None:
    return getattr(getattr(_aval(var), "sharding", None), "spec", None)


def _manual(var: Any, field: str) -> frozenset[str]:
    """`field` (varying/unreduced/reduced) of the manual-axis type inside shard_map.

    JAX 0.10+ keeps it in `aval.manual_axis_type`; earlier releases kept only
    the varying axes, in `aval.vma`. Neither: nothing manual.
    """
    aval = _aval(var)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, field, None) or ())
    if field == "varying":
        return frozenset(getattr(aval, "vma", None) or ())
    return frozenset()


def _reduced(var: Any) -> frozenset[str]:
    """Axes `var` is reduced over: explicit tag or manual axis type."""
    return reduced_axes(_spec(var)) | _manual(var, "reduced")


def _unreduced(var: Any) -> frozenset[str]:
    """Axes `var` holds per-device partial sums over: explicit tag or manual axis type."""
    return unreduced_axes(_spec(var)) | _manual(var, "unreduced")


def _elements(var: Any) -> int:
    """Elements of one device's block of `var` (what a collective on it moves)."""
    aval = _aval(var)
    shape = list(getattr(aval, "shape", ()))
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    sizes = dict(getattr(mesh, "shape", None) or {})
    # Inside shard_map the shape is already the block; its spec names no manual axis.
    for d, entry in enumerate(partitions(_spec(var))):
        if d < len(shape) and entry is not None:
            for axis in entry_axes(entry):
                shape[d] = -(-shape[d] // sizes.get(axis, 1))
    return math.prod(shape)


def _dim_axes(var: Any, dims: Iterable[int]) -> frozenset[str]:
    """Mesh axes sharding dimensions `dims` of `var` (explicit axes only)."""
    parts = partitions(_spec(var))
    found: set[str] = set()
    for d in dims:
        if d < len(parts) and parts[d] is not None:
            found.update(entry_axes(parts[d]))
    return frozenset(found)


def _contraction_sum_axes(eqn: Any) -> frozenset[str]:
    """Mesh axes a dot_general sums partial products over.

    An axis sharding a contracted dimension of one operand means local partial
    sums, unless the other operand shards one of its *free* dimensions over that
    same axis: then the two layouts conflict and the product gathers the first
    operand instead (FSDP's weight all-gather in the backward pass of `x @ w`,
    with `x` batch-sharded over the axis the weight's contracted dim uses). A
    gather moves data and reduces nothing, so it is no deferred reduction.
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[:2]

    def free_axes(var: Any, contracted: Sequence[int], batch: Sequence[int]) -> frozenset[str]:
        ndim = len(getattr(_aval(var), "shape", ()))
        return _dim_axes(var, [d for d in range(ndim) if d not in (*contracted, *batch)])

    lhs_sum = _dim_axes(lhs, lhs_c) - free_axes(rhs, rhs_c, rhs_b)
    rhs_sum = _dim_axes(rhs, rhs_c) - free_axes(lhs, lhs_c, lhs_b)
    return lhs_sum | rhs_sum


def _scan_counts(params: dict, n_in: int) -> tuple[int, int]:
    """(consts, carries) among a scan's operands.

    JAX up to 0.10 names the counts (`num_consts`, `num_carry`); newer JAX keeps
    the operand structure in `ft_in`, whose unpack splits operands into
    (consts, carry, xs): unpacking the operand indices gives the counts.
    """
    if "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(range(n_in))).unpack()
    return len(consts), len(carry)


def _is_literal(var: Any) -> bool:
    return type(var).__name__ == "Literal"


# ---------------------------------------------------------------- source lines

# Frames in these directories are library plumbing, not the model's lines.
# jaxlib (installed with jax, not imported by accum) is located, not imported.
_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (jax.__file__, importlib.util.find_spec("jaxlib").origin, __file__)
)


def _where(eqn: Any, depth: int = 2) -> str:
    """'file:line (function)' of the innermost `depth` frames outside jax, jaxlib and accum.

    Transposed equations carry the source info of the forward equation they
    came from, so for a backward equation this names the forward line; the
    caller's frame is added because that line is often in a helper (a `_dot`
    or `_gather` method). Reads the traceback's frames (public attributes of
    jaxlib's Traceback) rather than jax's private source_info_util; '?' when
    there are none.
    """
    frames = getattr(getattr(getattr(eqn, "source_info", None), "traceback", None), "frames", None)
    user = [
        f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
        for frame in frames or ()
        if not os.path.abspath(frame.file_name).startswith(_SKIP_DIRS)
    ]
    return ", called from ".join(user[:depth]) or "?"


def user_lines(eqn: Any, depth: int = 2) -> tuple[tuple[str, int], ...]:
    """(file basename, line) of the innermost `depth` frames outside jax, jaxlib
    and accum: the key the compiled verdict matches an HLO instruction's stack by."""
    frames = getattr(getattr(getattr(eqn, "source_info", None), "traceback", None), "frames", None)
    user = [
        (os.path.basename(frame.file_name), frame.line_num)
        for frame in frames or ()
        if not os.path.abspath(frame.file_name).startswith(_SKIP_DIRS)
    ]
    return tuple(user[:depth])


# ---------------------------------------------------------------- nested jaxprs


@dataclasses.dataclass
class _Region:
    """A nested jaxpr and how its inputs/outputs map onto the outer equation's.

    `ins[i]` / `outs[j]`: outer invar / outvar index of sub invar i / outvar j
    (None: unmapped). `loop`: (sub outvar, sub invar) pairs fed back each
    iteration (scan and while carries).
    """

    jaxpr: Any
    ins: list[int | None]
    outs: list[int | None]
    loop: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _open(obj: Any) -> Any | None:
    """The open Jaxpr of a Jaxpr or ClosedJaxpr; None for anything else."""
    inner = getattr(obj, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return inner
    return obj if hasattr(obj, "eqns") else None


def _regions(eqn: Any) -> list[_Region]:
    """Every nested jaxpr of `eqn`, mapped by the primitive's known layout.

    scan, while and cond have their own operand layouts; everything else JAX
    nests (jit, closed_call, remat, shard_map, custom_jvp/vjp calls) maps its
    operands and results one to one.
    """
    name, params = eqn.primitive.name, eqn.params
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    if name == "scan":
        consts, carry = _scan_counts(params, n_in)
        return [
            _Region(
                _open(params["jaxpr"]),
                list(range(n_in)),
                list(range(n_out)),
                [(i, consts + i) for i in range(carry)],
            )
        ]
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry = list(range(cn + bn, n_in))
        body = _Region(
            _open(params["body_jaxpr"]),
            list(range(cn, cn + bn)) + carry,
            list(range(n_out)),
            [(i, bn + i) for i in range(n_out)],
        )
        cond = _Region(_open(params["cond_jaxpr"]), list(range(cn)) + carry, [None])
        return [body, cond]
    if name == "cond":
        return [
            _Region(_open(b), list(range(1, n_in)), list(range(n_out))) for b in params["branches"]
        ]
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            sub = _open(item)
            if sub is not None and len(sub.invars) == n_in and len(sub.outvars) == n_out:
                found.append(_Region(sub, list(range(n_in)), list(range(n_out))))
    return found


# ---------------------------------------------------------------- the walk


def _partial_axes(eqn: Any, cotangent_in: Sequence[Any]) -> dict[str, Any]:
    """{axis: input} for each mesh axis an input of `eqn` is partial over.

    Partial means the op must sum over that axis: the input is unreduced over
    it, or (explicit mode) it shards a dimension the op contracts, or (inside
    shard_map) it is varying over an axis the collective sums over.
    """
    name, params = eqn.primitive.name, eqn.params
    found: dict[str, Any] = {}

    def add(axes, var):
        for a in axes:
            found.setdefault(a, var)

    for var in cotangent_in:
        add(_unreduced(var), var)
    if name == "dot_general":
        add(_contraction_sum_axes(eqn), eqn.invars[0])
    elif name in _REDUCE_PRIMITIVES:
        add(_dim_axes(eqn.invars[0], params.get("axes", ())), eqn.invars[0])
    elif name in _SCATTER_ADD and len(eqn.invars) >= 3:
        # Updates sharded over an axis the result is sharded over too (rows
        # scattered back into their own batch-sharded rows: take_along_axis's
        # transpose) add locally; only an axis the result does not shard sums.
        updates = eqn.invars[2]
        local = mesh_axes_used(_spec(eqn.outvars[0]))
        add(set(mesh_axes_used(_spec(updates))) - set(local), updates)
    elif name in _MANUAL_REDUCTIONS:
        axes = params.get("axes", params.get("axis_name", ()))
        axes = frozenset(axes if isinstance(axes, tuple | list) else (axes,))
        for var in cotangent_in:
            add(_manual(var, "varying") & axes, var)
    return found


class _Walker:
    """One forward pass over a vjp jaxpr, propagating labels from inputs to outputs.

    Labels: `_COTANGENT` (depends on the backward seed), `("param", path)`
    (depends on that parameter: used to blame forward drops), and `_Site`s (a
    deferred-axis reduction this value has passed through).
    """

    def __init__(self, axes: frozenset[str], trace_lines: bool = False):
        self.axes = axes
        # Label each backward value with the source lines it passed through, so
        # the compiled verdict can name the gradients an HLO instruction feeds.
        self.trace_lines = trace_lines
        self.sites: dict[int, _Site] = {}  # id(eqn) -> site, stable across loop re-walks
        self.drops: dict[str, list[str]] = {}  # param path -> forward drops
        # param path -> forward reductions of values computed from it
        self.forward: dict[str, list[_Site]] = {}

    def walk(self, jaxpr: Any, in_labels: Sequence[frozenset]) -> list[frozenset]:
        env = dict(zip(jaxpr.invars, in_labels, strict=True))
        for eqn in jaxpr.eqns:
            ins = [frozenset() if _is_literal(v) else env.get(v, frozenset()) for v in eqn.invars]
            regions = _regions(eqn)
            outs = self._nested(eqn, regions, ins) if regions else self._primitive(eqn, ins)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [frozenset() if _is_literal(v) else env.get(v, frozenset()) for v in jaxpr.outvars]

    def _primitive(self, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
        union = frozenset().union(*ins)
        if eqn.primitive.name in _LAYOUT_PRIMITIVES:
            self._forward_drop(eqn, eqn.invars[0], eqn.outvars[0], ins[0])
        if _COTANGENT in union:
            cotangent_in = [v for v, lab in zip(eqn.invars, ins, strict=True) if _COTANGENT in lab]
            union = self._without_resummed(eqn, cotangent_in, union)
            site = self._reduction(eqn, cotangent_in)
            if site is not None:
                union = union | {site}
            if self.trace_lines:
                union = union | {("line", user_lines(eqn), eqn.primitive.name)}
        elif _params_in(union) and _BATCH not in union:
            self._forward_reduction(eqn, ins)
        return [union] * len(eqn.outvars)

    def _forward_reduction(self, eqn: Any, ins: list[frozenset]) -> None:
        """Note a forward sum over a deferred axis of a value computed from the
        parameters alone (a weight psum'd inside shard_map): its transpose
        reduces that weight's gradient once per microbatch. Blamed on the
        parameters the value depends on; a backward contraction over the batch
        does not undo it (it is no cotangent), so it is kept apart from the
        backward sites. A sum of a value computed from the microbatch too (a
        psum of activations, a Gram matrix over the batch) is the model's own
        forward communication, which the compiled verdict does not count either."""
        computed = [v for v, lab in zip(eqn.invars, ins, strict=True) if _params_in(lab)]
        site = self._reduction(eqn, computed, "forward")
        if site is None:
            return
        for name in _params_in(frozenset().union(*ins)):
            if site not in self.forward.setdefault(name, []):
                self.forward[name].append(site)

    def _without_resummed(self, eqn: Any, cotangent_in: list[Any], labels: frozenset) -> frozenset:
        """`labels` less the sites over axes this equation makes partial again.

        A sum over an axis whose result stays unreduced over it (dW = x^T dy with
        the tokens sharded over that axis) leaves the gradient a per-device
        partial sum whatever happened upstream: an activation cotangent reduced
        by design (context parallelism's key/value gather, transposed) does not
        reduce the weight gradient computed from it. Layout ops never clear: a
        reshard only relabels a value that was already reduced.
        """
        if eqn.primitive.name in _LAYOUT_PRIMITIVES:
            return labels
        kept = frozenset().union(*(_unreduced(o) for o in eqn.outvars))
        # Partial over an axis no cotangent operand was partial over: this sum
        # (a contraction, or a scatter-add inside shard_map) made it partial.
        resummed = kept - frozenset().union(*(_unreduced(v) for v in cotangent_in))
        if not resummed:
            return labels
        return frozenset(
            lab for lab in labels if not (isinstance(lab, _Site) and lab.axes <= resummed)
        )

    def _nested(self, eqn: Any, regions: list[_Region], ins: list[frozenset]) -> list[frozenset]:
        outs = [frozenset()] * len(eqn.outvars)
        mapped = set()
        for region in regions:
            sub_in = [frozenset() if i is None else ins[i] for i in region.ins]
            for sub_var, i in zip(region.jaxpr.invars, region.ins, strict=True):
                if i is not None:  # a boundary whose inner type lost the tag
                    self._forward_drop(eqn, eqn.invars[i], sub_var, ins[i])
            sub_out = self._fixpoint(region, sub_in)
            for labels, j in zip(sub_out, region.outs, strict=True):
                if j is not None:
                    outs[j] |= labels
                    mapped.add(j)
        union = frozenset().union(*ins)
        # Results no region produced (never expected): depend on every operand.
        return [o if j in mapped else union for j, o in enumerate(outs)]

    def _fixpoint(self, region: _Region, sub_in: list[frozenset]) -> list[frozenset]:
        """Walk a region; for loops, feed carried labels back until they settle."""
        while True:
            sub_out = self.walk(region.jaxpr, sub_in)
            grown = list(sub_in)
            for src, dst in region.loop:
                grown[dst] = grown[dst] | sub_out[src]
            if grown == sub_in:
                return sub_out
            sub_in = grown

    def _reduction(self, eqn: Any, inputs: list[Any], pass_: str = "backward") -> _Site | None:
        """The site if `eqn` sums one of `inputs` (cotangents, or in the forward
        pass values computed from the parameters) over a deferred axis into more
        than MAX_ELEMENTS elements per device, else None. Smaller sums (a loss,
        a count) are what the compiled verdict lets pass too."""
        partial = _partial_axes(eqn, inputs)
        kept = frozenset().union(*(_unreduced(o) for o in eqn.outvars))
        lost = sorted(a for a in partial if a in self.axes and a not in kept)
        if not lost or max(_elements(o) for o in eqn.outvars) <= MAX_ELEMENTS:
            return None
        if id(eqn) not in self.sites:
            src = partial[lost[0]]
            self.sites[id(eqn)] = _Site(
                f"{eqn.primitive.name}: {src.aval} -> {eqn.outvars[0].aval} reduces "
                f"{lost} in the {pass_} pass of {_where(eqn)}",
                frozenset(lost),
            )
        return self.sites[id(eqn)]

    def _forward_drop(self, eqn: Any, src: Any, dst: Any, labels: frozenset) -> None:
        lost = sorted((_reduced(src) & self.axes) - _reduced(dst))
        if not lost:
            return
        what = (
            f"{eqn.primitive.name}: {src.aval} -> {dst.aval} drops reduced {lost} at {_where(eqn)}"
        )
        for name in _params_in(labels):
            if what not in self.drops.setdefault(name, []):
                self.drops[name].append(what)


# ---------------------------------------------------------------- tracing


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
    labels = [frozenset({_param(p)}) for p in paths]
    labels += [frozenset({_BATCH})] * n_args + [frozenset({_COTANGENT})]
    record = active_record()
    walker = _Walker(frozenset(axes), trace_lines=record is not None)
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
        deferred = _reduced(var)
        sites = sorted(lab.text for lab in out if isinstance(lab, _Site) and lab.axes & deferred)
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
