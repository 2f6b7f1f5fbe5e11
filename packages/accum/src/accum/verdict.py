"""The exact verdict: does the compiled step reduce a deferred axis inside the loop?

Whether a gradient reduction runs once per microbatch is a fact of the compiled
program (after SPMD partitioning and XLA's optimizations), not of the jaxpr.
accum marks the places where a reduction over a deferred axis would be a loss:

- the microbatch loop of `accumulate_gradients`, with a JAX name scope on its
  `lax.scan` (the scope lands in the `while` instruction's `op_name`);
- the body of `accum.add` (each call *is* one microbatch: the host loop).

The scope names the axes every gradient defers (the plan's strict axes) and the
mesh's axis sizes, so the compiled text alone says what to look for:
`accum_microbatch_loop[data|data=8,tensor=1]`. `in_loop_reductions` reads the
compiled HLO (hlo_tools: call graph, while loops, trip counts, replica groups
as mesh axes) for an all-reduce or reduce-scatter (async forms included) of more
than `MAX_ELEMENTS` elements in one array, spanning one of those axes, under such
a mark, made by the backward pass and flowing into the accumulator: a
gradient's reduction (`in_backward`, `accumulates`; a forward psum of
activations is the model's own, an activation cotangent's feeds backward
compute instead). `check_compiled` raises `TagLostError` (or warns) naming the HLO
instruction, the source line XLA kept for it, the bytes per step and the
parameters whose gradient it carries; `compile_checked` compiles a user's step
and hands back the executable it checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax

import hlo_tools
from accum.plan import PER_STEP, _is_leaf_plan
from accum.trace_record import (  # noqa: F401 - recording, active_record: re-exported
    TraceRecord,
    active_record,
    is_add,
    merged,
    record_params,
    recording,
    records_in,
    trace_number,
)
from hlo_tools.frames import Frame, StackFrames
from pspec_tags import TagLostError

ON_TAG_LOST = ("raise", "warn", "ignore")
LOOP_SCOPE = "accum_microbatch_loop"
ADD_SCOPE = "accum_add"
# A loss, a token count or a handful of aux metrics may be summed per microbatch;
# a gradient is larger. Judged per array: XLA's combiner may merge many scalars.
MAX_ELEMENTS = 8
_MARK = re.compile(rf"({LOOP_SCOPE}|{ADD_SCOPE})\[([^|\]]*)\|([^\]]*)\]")

# Frames in these directories are library plumbing, not the user's line.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (jax, hlo_tools)
    if getattr(m, "__file__", None)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep, f"{os.sep}site-packages{os.sep}")


def check_option(on_tag_lost: str) -> None:
    """Reject an `on_tag_lost` that is not raise / warn / ignore, naming it."""
    if on_tag_lost not in ON_TAG_LOST:
        raise ValueError(f"on_tag_lost={on_tag_lost!r} is not one of {ON_TAG_LOST}")


def scope_name(kind: str, axes: tuple[str, ...], mesh_shape: Mapping[str, int]) -> str:
    """The name scope marking a region where reducing `axes` is a loss, e.g.
    `accum_microbatch_loop[data|data=8,tensor=1]`."""
    sizes = ",".join(f"{a}={n}" for a, n in mesh_shape.items())
    return f"{kind}[{','.join(axes)}|{sizes}]"


def marked(kind: str, axes: tuple[str, ...], mesh_shape: Mapping[str, int]) -> Any:
    """A name scope for `kind` over `axes`; a no-op when there are no axes to watch."""
    if not axes:
        return contextlib.nullcontext()
    return jax.named_scope(scope_name(kind, axes, mesh_shape))


def _mark_of(op_name: str, kind: str) -> tuple[tuple[str, ...], dict[str, int]] | None:
    """(watched axes, mesh shape) of the innermost `kind` mark in an op_name."""
    found = [m for m in _MARK.finditer(op_name) if m.group(1) == kind]
    if not found:
        return None
    m = found[-1]
    axes = tuple(a for a in m.group(2).split(",") if a)
    sizes = dict(item.split("=") for item in m.group(3).split(",") if item)
    return axes, {a: int(n) for a, n in sizes.items()}


# ---------------------------------------------------------------- the compiled fact


@dataclasses.dataclass(frozen=True)
class Finding:
    """One reduction over deferred `axes` where it runs once per microbatch."""

    collective: hlo_tools.Collective
    axes: tuple[str, ...]
    where: str  # "loop" (accumulate_gradients) or "add" (accum.add)
    frames: tuple[Frame, ...]
    strict: bool = True  # over an axis every gradient defers (the mark's); else judged per leaf
    trace: int | None = None  # the accumulation's trace number (accum.trace_record)

    @property
    def bytes_per_step(self) -> int:
        """Bytes it moves per step (per microbatch for `accum.add`)."""
        return self.collective.bytes_per_step or self.collective.bytes


def _largest_array(c: hlo_tools.Collective) -> int:
    return max((a.elements for a in c.arrays), default=0)


def _mark_for(
    c: hlo_tools.Collective, plans: Mapping[int, Any]
) -> tuple[str, tuple, tuple, dict, hlo_tools.Loop | None, int | None] | None:
    """("loop"|"add", strict axes, watched axes, mesh shape, the marked loop's
    while instruction or None for `accum.add`, trace number) when `c` runs
    inside an accumulation's microbatch loop or `add` body, else None.

    The strict axes come from the name scope (every gradient defers them); the
    watched ones add each axis some gradient defers, read from the plan of the
    trace the op_name names (`plans`): a reduction over those is judged per leaf.
    """
    for loop in c.loops:  # outermost first: the microbatch loop encloses the model's
        number = trace_number(loop.op_name)
        mark = _mark_of(loop.op_name, LOOP_SCOPE)
        if mark is None and number not in plans:
            continue
        strict, sizes = mark or ((), {})
        plan = plans.get(number)
        if plan is not None:
            sizes = sizes or dict(plan.mesh_shape)
        return ("loop", strict, _watched(strict, plan), sizes, loop, number)
    mark = _mark_of(c.op_name, ADD_SCOPE)
    number = trace_number(c.op_name)
    # Unmarked and outside every loop: an `accum.add` body's op, judged by its
    # plan; a microbatch loop's op that XLA hoisted after the loop (its
    # op_name keeps the loop's trace number) runs once per step: not a finding.
    if mark is None and (number not in plans or c.loops or not is_add(number)):
        return None
    strict, sizes = mark or ((), dict(plans[number].mesh_shape))
    return ("add", strict, _watched(strict, plans.get(number)), sizes, None, number)


def _watched(strict: tuple[str, ...], plan: Any) -> tuple[str, ...]:
    """`strict` and the axes `plan` defers for some gradient (none without a plan)."""
    # Not SCATTER: those axes are reduce-scattered per microbatch by design.
    deferred = () if plan is None else plan.axes(PER_STEP)
    return tuple(dict.fromkeys((*strict, *deferred)))


def _carry(module: Any, loop: hlo_tools.Loop | None) -> str:
    """The computation whose ROOT holds the accumulator: the marked loop's body
    (its carry), or ENTRY for an `accum.add` body (the program's output)."""
    if loop is None:
        return module.entry_name
    while_instr = module.computations[loop.computation].by_name[loop.name]
    return while_instr.attributes["body"].lstrip("%")


def in_backward(op_name: str) -> bool:
    """Whether an op_name is of the backward pass, where gradients are made: JAX
    names transposed ops `transpose(...)`, and forward ops recomputed for the
    backward pass (remat) `.../rematted_computation/...`, which are forward ops.
    A forward reduction (a psum of activations, a Gram matrix over the batch) is
    the model's own communication: the loss needs its value, no deferral moves it.
    XLA joins merged ops' names with ':'; a collective without a name (one XLA
    made) counts as backward."""
    if not op_name:
        return True
    return any(
        "transpose(" in part and "rematted_computation" not in part for part in op_name.split(":")
    )


def accumulates(module: Any, c: hlo_tools.Collective, carry: str) -> bool:
    """Whether an array (of more than MAX_ELEMENTS elements) that `c` reduces flows
    into the accumulator: to `carry`'s ROOT through moves, converts, scales and
    adds, never through a contraction (hlo_tools.reaches_root).

    That is what a gradient's reduction does. An activation cotangent's feeds the
    backward dots (weight and input gradients) or a norm's sums instead:
    context parallelism's attention reduces the cotangents of its all-gathered
    keys and values over 'context' every microbatch, by construction, in
    explicit and auto mode alike, and deferral has nothing to move there. Read
    from the program, not from shapes: an activation may have a weight's shape
    (on a small model it does), and XLA may pad or concatenate gradients.
    """
    instr = module.computations[c.computation].by_name[c.name]
    elements = hlo_tools.dataflow.tuple_elements(instr)
    if elements != len(c.arrays):  # an array, or a -start tuple with more than outputs
        indices = [None] if _largest_array(c) > MAX_ELEMENTS else []
    else:
        indices = [i for i, a in enumerate(c.arrays) if a.elements > MAX_ELEMENTS]
    return any(
        hlo_tools.reaches_root(module, c.computation, c.name, target=carry, index=i)
        for i in indices
    )


def in_loop_reductions(
    text: str, module: hlo_tools.HloModule | None = None, plans: Mapping[int, Any] | None = None
) -> list[Finding]:
    """Gradient reductions over a watched axis inside a marked loop or `accum.add` body.

    Each all-reduce / reduce-scatter (start forms included; TPU async fusions
    counted once, by hlo_tools) with an array of more than `MAX_ELEMENTS`
    elements, whose replica groups span a watched axis of its mark, made by the
    backward pass (`in_backward`) and whose result the loop accumulates
    (`accumulates`): a gradient's reduction, not an activation's. `plans`
    ({trace number: ReductionPlan}; default: the registered traces the text
    names) add the axes some gradient defers: a finding over those alone has
    `strict=False`, and `check_compiled` judges it per parameter.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> w2 = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P()))  # 16 elements
    >>> def drops_tag(w, mb):  # resharding w onto P() drops its reduced tag
    ...     return loss_fn(jax.reshard(w, P()), mb)
    >>> def step(w, b):
    ...     return accum.accumulate_gradients(
    ...         drops_tag, w, b, num_microbatches=2, on_tag_lost="ignore"
    ...     )
    >>> with jax.set_mesh(mesh):
    ...     text = jax.jit(step).lower(w2, batch).compile().as_text()
    >>> [(f.collective.kind, f.axes, f.collective.multiplier) for f in
    ...  accum.in_loop_reductions(text)]
    [('all-reduce', ('data',), 2)]
    """
    if plans is None:
        plans = {n: r.plans[n] for n, r in records_in(text).items() if n in r.plans}
    if LOOP_SCOPE not in text and ADD_SCOPE not in text and not plans:
        return []  # nothing marked: no deferred axis to watch
    # `module`: `text` already parsed by the caller (the trainer's startup summary).
    module = module or hlo_tools.parse(text)
    found = []
    for c in hlo_tools.collectives(module):
        if c.kind not in hlo_tools.REDUCTION_KINDS or not c.cross_replica:
            continue
        if _largest_array(c) <= MAX_ELEMENTS:
            continue
        mark = _mark_for(c, plans)
        if mark is None:
            continue
        where, strict, axes, mesh_shape, loop, number = mark
        spanned = tuple(a for a in axes if hlo_tools.spans_mesh_axis(c, mesh_shape, a))
        if spanned and in_backward(c.op_name) and accumulates(module, c, _carry(module, loop)):
            is_strict = any(a in strict for a in spanned)
            found.append(Finding(c, spanned, where, (), is_strict, number))
    if not found:
        return found
    # Source lines only for what is reported: the tables are a pass over the text.
    frames = StackFrames(text)
    return [
        dataclasses.replace(f, frames=tuple(frames.of(_instruction(module, f.collective))))
        for f in found
    ]


def _instruction(module: Any, c: hlo_tools.Collective) -> Any:
    comp = module.computations[c.computation]
    return next(i for i in comp.instructions if i.name == c.name)


# ---------------------------------------------------------------- the message


def user_frames(frames: tuple[Frame, ...], depth: int = 2) -> str:
    """The innermost `depth` frames outside jax, hlo_tools, accum and installed
    packages, joined; the innermost frame when all are library frames; '?' for none."""
    user = [f for f in frames if not os.path.abspath(f.file).startswith(_LIBRARY_DIRS)]
    chosen = user[:depth] or list(frames[:1])
    return ", called from ".join(map(str, chosen)) or "?"


def _blamed(finding: Finding, record: TraceRecord | None) -> tuple[list[str], str]:
    """The parameters whose gradient the collective carries.

    Candidates are the parameters whose per-device or global gradient (or one
    layer of it) has the shape of one of the collective's arrays, in any
    dimension order (XLA may keep a transposed layout). Among them, in order:
    the trace-time analysis's suspects; those whose gradient flows through a
    backward equation of the instruction's primitive and source lines (the
    trace-time walk labels each backward value with them); those whose tag a
    forward layout op dropped; else all.
    """
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


def _blame(finding: Finding, record: TraceRecord | None) -> str:
    """`_blamed` as the message prints it."""
    if record is None:
        return "(no trace record: compile with accum.compile_checked to name it)"
    names, why = _blamed(finding, record)
    if not names:
        return "no parameter of this shape (a value computed from the parameters)"
    return f"{', '.join(map(_display, names))} ({why})"


def _by_plan(finding: Finding, record: TraceRecord | None) -> bool:
    """Whether a reduction over axes only some gradients defer is the plan's.
    Judged per reduced array (XLA combines many): one a parameter of its shape
    reduced per use or per microbatch may carry is the plan's (a reduce-scatter
    lowered to an all-reduce looks like a replicated weight's gradient), as is
    one no parameter explains (an FSDP gather's transpose in a shard_map); one
    only deferring parameters can carry is not."""
    plan = None if record is None else record.plans.get(finding.trace)
    names = [] if plan is None else _blamed(finding, record)[0]
    if not names:
        return plan is not None
    flat = jax.tree_util.tree_flatten_with_path(plan.leaves, is_leaf=_is_leaf_plan)[0]
    leaves = {jax.tree_util.keystr(path): leaf for path, leaf in flat}
    axes = set(finding.axes)
    asked = {n for n in names if n in leaves and not set(leaves[n].tagged) & axes}
    for array in finding.collective.arrays:
        if array.elements <= MAX_ELEMENTS:
            continue
        dims = tuple(sorted(array.dims))
        shaped = [n for n in names if any(dims in _slice_shapes(s) for s in record.shapes[n])]
        if not set(shaped or names) & asked:
            return False
    return True


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
    user = [f for f in frames if not os.path.abspath(f.file).startswith(_LIBRARY_DIRS)]
    return tuple((os.path.basename(f.file), f.line) for f in user[:depth])


def _slice_shapes(shape: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The shape and those of its trailing slices (one layer of a stacked
    parameter, reduced inside the layer scan), each with its dims sorted."""
    return {tuple(sorted(shape[i:])) for i in range(len(shape))}


def _display(path: str) -> str:
    """A key path as printed; the root (a bare array of parameters) as 'params'."""
    return path or "params"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def message(findings: list[Finding], record: TraceRecord | None) -> str:
    """The TagLostError text: each reduction, what it carries, where it came from."""
    total = sum(f.bytes_per_step for f in findings)
    axes = sorted({a for f in findings for a in f.axes})
    lines = [
        f"the compiled step reduces deferred axis/axes {axes} once per microbatch: "
        f"{len(findings)} reduction(s), {_size(total)} per step that deferral should "
        "have moved after the loop:"
    ]
    for f in findings:
        c = f.collective
        per = "per step" if f.where == "loop" else "per accum.add call"
        times = "?" if c.multiplier is None else c.multiplier
        lines += [
            f"  {c.kind} {c.type_str} over {list(f.axes)} x{times} = "
            f"{_size(f.bytes_per_step)} {per}  (HLO %{c.name} in %{c.computation})",
            f"    gradient of: {_blame(f, record)}",
            f"    source: {user_frames(f.frames)}",
            f"    op_name: {c.op_name or '<none>'}",
        ]
    lines.append(
        "Keep each parameter's reduced tag up to its use: reshard onto "
        "carry_reduced_axes(spec, param) instead of a spec rebuilt from logical rules; use "
        "broadcast_param for elementwise use, and shard_map in_specs that carry the tag."
    )
    return "\n".join(lines)


def check_compiled(text: str, on_tag_lost: str = "raise", record: TraceRecord | None = None):
    """Raise `TagLostError` (warn: `RuntimeWarning`; ignore: nothing) when the
    compiled HLO `text` reduces a deferred axis inside accum's microbatch loop or
    an `accum.add` body: a reduction whose result the loop accumulates (a
    gradient's; `accumulates`). The trace `record` names the parameters in the
    message. Returns the findings.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> w2 = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P()))
    >>> def drops_tag(w, mb):
    ...     return loss_fn(jax.reshard(w, P()), mb)
    >>> def step(w, b):
    ...     return accum.accumulate_gradients(
    ...         drops_tag, w, b, num_microbatches=2, on_tag_lost="ignore"
    ...     )
    >>> with jax.set_mesh(mesh):
    ...     text = jax.jit(step).lower(w2, batch).compile().as_text()
    >>> accum.check_compiled(text)
    Traceback (most recent call last):
    ...
    pspec_tags.guards.TagLostError: the compiled step reduces deferred axis/axes ['data'] ...
    """
    check_option(on_tag_lost)
    if on_tag_lost == "ignore":
        return []
    records = records_in(text)
    record = merged([r for r in (record, *records.values()) if r is not None])
    plans = {n: r.plans[n] for n, r in records.items() if n in r.plans}
    findings = in_loop_reductions(text, plans=plans)
    # An axis only some gradients defer: judged per parameter against the plan.
    findings = [f for f in findings if f.strict or not _by_plan(f, record)]
    if findings:
        text = message(findings, record)
        if on_tag_lost == "warn":
            warnings.warn(text, RuntimeWarning, stacklevel=3)
        else:
            raise TagLostError(text)
    return findings


def compile_checked(
    fn: Any,
    *args: Any,
    on_tag_lost: str = "raise",
    compiler_options: dict | None = None,
    **kwargs: Any,
) -> Any:
    """Compile `fn(*args, **kwargs)` and check it: the executable, checked.

    `fn` is a `jax.jit`-ed function (or a plain one, jitted here) whose body
    calls `accumulate_gradients` (train_step, zero1_step...) or `accum.add`.
    Lowers and compiles once, then raises `TagLostError` if and only if the
    compiled program runs a gradient's reduction over a deferred axis inside the
    microbatch loop (`check_compiled`). Call the returned executable: it is the
    program that was checked (no second compile), with the dynamic arguments
    only (static ones are compiled in). The trace-time analysis runs
    during lowering only to name the parameters in the message.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> def step(w, b):
    ...     return accum.accumulate_gradients(loss_fn, w, b, num_microbatches=2)
    >>> with jax.set_mesh(mesh):
    ...     compiled = accum.compile_checked(step, w, batch)
    ...     loss, aux, grads = compiled(w, batch)
    >>> float(loss)
    8.0
    """
    check_option(on_tag_lost)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    with recording() as record:
        lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile(compiler_options=compiler_options)
    check_compiled(compiled.as_text(), on_tag_lost, record)
    return compiled
