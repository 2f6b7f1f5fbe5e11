"""Which parameters a reduction the compiled verdict found carries.

First by dataflow: accum adds each microbatch's gradient into its accumulator
leaf by leaf, each addition in the name scope `accum_grad[<leaf index>]`
(`add_marked`), which XLA keeps in the op_name of the addition (inside
fusions too). Following a reduced array forward (hlo_tools.first_marked) to
the first marked addition names the parameter exactly, whatever its shape:
two parameters of one shape, one reduced per use by design and one whose
deferral a dropped tag undid, are told apart. Where no marked addition is
reached (a schedule that adds inside the backward layer scan, an XLA rewrite
that lost the op_name), by shape and the trace-time record, as before.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax

import hlo_tools
from accum.plan import _is_leaf_plan
from accum.trace_record import TraceRecord
from hlo_tools.frames import Frame

# A loss, a token count or a handful of aux metrics may be summed per microbatch;
# a gradient is larger. Judged per array: XLA's combiner may merge many scalars.
MAX_ELEMENTS = 8
GRAD_SCOPE = "accum_grad"
_GRAD_MARK = re.compile(rf"{GRAD_SCOPE}\[(\d+)\]")

# Frames in these directories are library plumbing, not the user's line.
LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (jax, hlo_tools)
    if getattr(m, "__file__", None)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep, f"{os.sep}site-packages{os.sep}")


def add_marked(acc: Any, grads: Any) -> Any:
    """`acc + grads` leaf by leaf in the accumulator's dtype, each addition in
    the name scope `accum_grad[k]` (k: the leaf's position in the flattened
    tree, the parameters' order) so the verdict can follow a reduced array to
    the parameter whose accumulator it enters."""
    acc_leaves, treedef = jax.tree.flatten(acc)
    grad_leaves = treedef.flatten_up_to(grads)
    added = []
    for k, (a, g) in enumerate(zip(acc_leaves, grad_leaves, strict=True)):
        with jax.named_scope(f"{GRAD_SCOPE}[{k}]"):
            added.append(a + g.astype(a.dtype))
    return jax.tree.unflatten(treedef, added)


def _leaves(plan: Any) -> dict[str, Any]:
    """{parameter path (`jax.tree_util.keystr`): LeafPlan}, in leaf order."""
    flat = jax.tree_util.tree_flatten_with_path(plan.leaves, is_leaf=_is_leaf_plan)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def per_array(module: Any, c: hlo_tools.Collective) -> bool:
    """Whether `c` returns one tuple element per array it reduces (XLA's combiner
    merged several reductions), so each array can be followed on its own."""
    instr = module.computations[c.computation].by_name[c.name]
    return hlo_tools.dataflow.tuple_elements(instr) == len(c.arrays) > 1


def carried(module: Any, c: hlo_tools.Collective, plan: Any) -> tuple[tuple[str, ...], ...]:
    """For each of `c`'s arrays, the parameters (paths, sorted) whose
    accumulator it is added into by a marked addition of `plan`'s
    accumulation; () where none is reached or there is no plan."""
    if plan is None:
        return ((),) * len(c.arrays)
    paths = list(_leaves(plan))
    each = per_array(module, c)
    out = []
    for i in range(len(c.arrays)):
        index = i if each else None
        found = hlo_tools.first_marked(
            module, c.computation, c.name, pattern=_GRAD_MARK, index=index
        )
        out.append(tuple(sorted(paths[int(k)] for k in found if int(k) < len(paths))))
    return tuple(out)


def blamed(finding: Any, record: TraceRecord | None) -> tuple[list[str], str]:
    """The parameters whose gradient the collective carries.

    The parameters whose accumulators its arrays are added into (`carried`),
    when known. Else candidates are the parameters whose per-device or global
    gradient (or one layer of it) has the shape of one of the collective's
    arrays, in any dimension order (XLA may keep a transposed layout). Among
    them, in order: the trace-time analysis's suspects; those whose gradient
    flows through a backward equation of the instruction's primitive and source
    lines (the trace-time walk labels each backward value with them); those
    whose tag a forward layout op dropped; else all.
    """
    exact = sorted({p for paths in finding.carried for p in paths})
    plan = None if record is None else record.plans.get(finding.trace)
    if exact and plan is not None:  # of a combined reduction, those that defer its axes
        deferring = sorted(set(exact) - _asked(exact, _leaves(plan), set(finding.axes)))
        exact = deferring or exact
    if exact:
        return exact, "its reduction is added into that parameter's accumulator"
    if record is None:
        return [], ""
    c = finding.collective
    by_shape = _params_shaped_like(c, record)
    key, prims = _user_key(finding.frames), _primitives(c.op_name)

    def flows_through(path: str) -> bool:
        return any(
            lines and key[: len(lines)] == lines and prim in prims
            for lines, prim in record.lines.get(path, ())
        )

    for why, names in (
        ("trace-time analysis", [p for p in by_shape if p in record.suspects]),
        ("its gradient flows through that operation", [p for p in by_shape if flows_through(p)]),
        ("its reduced tag was dropped", [p for p in by_shape if p in record.dropped]),
        ("by shape", by_shape),
    ):
        if names:
            return names, why
    return [], ""


def blame(finding: Any, record: TraceRecord | None) -> str:
    """`blamed` as the message prints it."""
    if record is None and not any(finding.carried):
        return "(no trace record: compile with accum.compile_checked to name it)"
    names, why = blamed(finding, record)
    if not names:
        return "no parameter of this shape (a value computed from the parameters)"
    return f"{', '.join(map(display, names))} ({why})"


def by_plan(finding: Any, record: TraceRecord | None) -> bool:
    """Whether a reduction over axes only some gradients defer is the plan's.

    Judged per reduced array (XLA combines many), gradients' only (a forward
    psum combined with them is the model's own). An array followed into the
    accumulators of parameters (`carried`) is the plan's iff the plan reduces
    each of them per use or per microbatch over those axes. Otherwise, by shape:
    one a parameter of its shape reduced per use or per microbatch may carry
    is the plan's (a reduce-scatter lowered to an all-reduce looks like a
    replicated weight's gradient), as is one no parameter explains (an FSDP
    gather's transpose in a shard_map); one only deferring parameters can
    carry is not."""
    plan = None if record is None else record.plans.get(finding.trace)
    names = [] if plan is None else blamed(finding, record)[0]
    if not names:
        return plan is not None
    leaves = _leaves(plan)
    axes = set(finding.axes)
    asked = _asked(names, leaves, axes)
    arrays = finding.collective.arrays
    exact = finding.carried or ((),) * len(arrays)
    gradients = finding.gradients or (True,) * len(arrays)
    for array, into, gradient in zip(arrays, exact, gradients, strict=True):
        if array.elements <= MAX_ELEMENTS or not gradient:
            continue  # a scalar, or a forward psum XLA combined with it: not a gradient's
        if into:  # dataflow: exactly these accumulators
            if not set(into) <= _asked(into, leaves, axes):
                return False
            continue  # every one reduced per use or per microbatch: the plan's
        dims = tuple(sorted(array.dims))
        shaped = [n for n in names if any(dims in _slice_shapes(s) for s in record.shapes[n])]
        if not set(shaped or names) & asked:
            return False
    return True


def _asked(paths: Any, leaves: dict, axes: set[str]) -> set[str]:
    """Those of `paths` the plan does not defer over `axes` (reduced per use or
    per microbatch there: their reduction in the loop is the plan's)."""
    return {p for p in paths if p in leaves and not set(leaves[p].tagged) & axes}


def _params_shaped_like(c: hlo_tools.Collective, record: TraceRecord) -> list[str]:
    """The parameters (sorted paths) whose per-device or global gradient, or one
    layer of it, has the shape of one of `c`'s arrays of more than MAX_ELEMENTS
    elements, in any dimension order (XLA may reduce a dot's output before its
    transpose)."""
    dims = {tuple(sorted(a.dims)) for a in c.arrays if a.elements > MAX_ELEMENTS}
    return sorted(
        p for p, shapes in record.shapes.items() if any(_slice_shapes(s) & dims for s in shapes)
    )


def _primitives(op_name: str) -> set[str]:
    """The JAX primitives an op_name ends in; XLA joins merged ops' names with ':'."""
    return {part.rsplit("/", 1)[-1].strip("()") for part in op_name.split(":")}


def _user_key(frames: tuple[Frame, ...], depth: int = 2) -> tuple[tuple[str, int], ...]:
    """(file basename, line) of the innermost `depth` user frames (source_lines.user_lines' key)."""
    user = [f for f in frames if not os.path.abspath(f.file).startswith(LIBRARY_DIRS)]
    return tuple((os.path.basename(f.file), f.line) for f in user[:depth])


def _slice_shapes(shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The shape and those of its trailing slices (one layer of a stacked
    parameter, reduced inside the layer scan), each with its dims sorted."""
    return {tuple(sorted(shape[i:])) for i in range(len(shape))}


def display(path: str) -> str:
    """A key path as printed; the root (a bare array of parameters) as 'params'."""
    return path or "params"
