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
from accum.blame import (
    LIBRARY_DIRS,
    MAX_ELEMENTS,
    blame,
    blamed,
    by_plan,
    carried,
    display,
    per_array,
)
from accum.partition_meta import placed
from accum.plan import PER_STEP
from accum.step_outputs import pinned
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
_MARK = re.compile(rf"({LOOP_SCOPE}|{ADD_SCOPE})\[([^|\]]*)\|([^\]]*)\]")


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
    # Per array of the collective: the parameters whose accumulator it is added
    # into (accum.blame.carried), () where no marked addition was reached or the
    # array is not a gradient's reduction.
    carried: tuple[tuple[str, ...], ...] = ()
    # Per array: whether it is a gradient's reduction (backward, accumulated).
    # XLA's combiner merges a forward psum with a backward one: only these are
    # judged (accum.blame.by_plan). () : every array.
    gradients: tuple[bool, ...] = ()

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


def array_op_names(module: Any, c: hlo_tools.Collective) -> tuple[str, ...]:
    """Per array `c` reduces, the op_name of the reduction it came from. XLA's
    combiner merges reductions into one of a tuple (its op_name joins theirs
    with ':') and keeps each one's op_name on the get-tuple-element of its
    element; where that is not found (an array, an async -start form), `c`'s."""
    names = [c.op_name] * len(c.arrays)
    if not per_array(module, c):
        return tuple(names)
    for user, _ in hlo_tools.dataflow.users(module).get((c.computation, c.name), []):
        index = user.attributes.get("index", "")
        if user.opcode == "get-tuple-element" and index.isdigit() and user.op_name:
            names[int(index)] = user.op_name
    return tuple(names)


def accumulates(
    module: Any, c: hlo_tools.Collective, carry: str, judged: tuple[bool, ...] = ()
) -> bool:
    """Whether an array (of more than MAX_ELEMENTS elements; of those `judged`
    marks, when given) that `c` reduces flows into the accumulator: to `carry`'s
    ROOT through moves, converts, scales and adds, never through a contraction
    (hlo_tools.reaches_root).

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
        indices = [
            i
            for i, a in enumerate(c.arrays)
            if a.elements > MAX_ELEMENTS and (not judged or judged[i])
        ]
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
    (`accumulates`): a gradient's reduction, not an activation's. A combined
    reduction is judged array by array (`array_op_names`): a forward psum XLA
    merged with a backward one by design is still the model's own. `plans`
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
        if not spanned:
            continue
        backward = tuple(in_backward(name) for name in array_op_names(module, c))
        if any(backward) and accumulates(module, c, _carry(module, loop), backward):
            is_strict = any(a in strict for a in spanned)
            into = carried(module, c, plans.get(number))
            # A forward array's accumulator is not blamed: its reduction is the model's.
            into = tuple(p if b else () for p, b in zip(into, backward, strict=True))
            found.append(Finding(c, spanned, where, (), is_strict, number, into, backward))
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
    user = [f for f in frames if not os.path.abspath(f.file).startswith(LIBRARY_DIRS)]
    chosen = user[:depth] or list(frames[:1])
    return ", called from ".join(map(str, chosen)) or "?"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def message(findings: list[Finding], record: TraceRecord | None) -> str:
    """The full TagLostError report (`TagLostError.report`): each reduction, what
    it carries, where it came from."""
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
            f"    gradient of: {blame(f, record)}",
            f"    source: {user_frames(f.frames)}",
            f"    op_name: {c.op_name or '<none>'}",
        ]
    lines.append(_FIX)
    return "\n".join(lines)


_FIX = (
    "Keep each parameter's reduced tag up to its use: reshard onto "
    "carry_reduced_axes(spec, param) instead of a spec rebuilt from logical rules; use "
    "broadcast_param for elementwise use, and shard_map in_specs that carry the tag."
)


def _written(name: str, record: TraceRecord | None) -> str:
    """A parameter as the user wrote it: its path (nnx's `.value` left off) and
    its dtype and global shape."""
    shown = display(name.removesuffix(".value"))
    shape = None if record is None else record.written.get(name)
    return f"{shown} ({shape})" if shape else shown


def summary(findings: list[Finding], record: TraceRecord | None) -> str:
    """The TagLostError itself: one line naming the parameters (path, written
    shape), the axes, the cost and the user's source line; `message` the rest."""
    names = sorted({n for f in findings for n in blamed(f, record)[0]})
    what = ", ".join(_written(n, record) for n in names) or "a value computed from the parameters"
    axes = sorted({a for f in findings for a in f.axes})
    where = {"per accum.add call" if f.where == "add" else "per microbatch" for f in findings}
    total = _size(sum(f.bytes_per_step for f in findings))
    return (
        f"the gradient of {what} is reduced over {axes} {' and '.join(sorted(where))} "
        f"instead of once per step ({len(findings)} reduction(s), {total} per step; "
        f"source: {user_frames(findings[0].frames, depth=1)}): keep its reduced tag up to "
        "its use (carry_reduced_axes, broadcast_param); the error's .report has the details"
    )


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
    pspec_tags.guards.TagLostError: the gradient of ... over ['data'] per microbatch ...
    """
    check_option(on_tag_lost)
    if on_tag_lost == "ignore":
        return []
    records = records_in(text)
    record = merged([r for r in (record, *records.values()) if r is not None])
    plans = {n: r.plans[n] for n, r in records.items() if n in r.plans}
    findings = in_loop_reductions(text, plans=plans)
    # An axis only some gradients defer: judged per parameter against the plan.
    findings = [f for f in findings if f.strict or not by_plan(f, record)]
    if findings:
        line, report = summary(findings, record), message(findings, record)
        if on_tag_lost == "warn":  # asked to go on: the whole report, once
            warnings.warn(f"{line}\n{report}", RuntimeWarning, stacklevel=3)
        else:
            error = TagLostError(line)  # one line; the report on request
            error.report = report
            raise error
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
    only (static ones are compiled in). A plain `fn` on an auto mesh gets each
    output that mirrors the argument of its position (`(params, state, ...)`)
    laid out like it, so the executable runs step after step on its own
    outputs; a `jax.jit`-ed `fn` keeps its own `out_shardings`. The trace-time analysis runs
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
    # A plain `fn` on an auto mesh: its outputs that mirror inputs keep their
    # layout, so the executable takes them back next step (accum.step_outputs).
    jitted = fn if hasattr(fn, "lower") else jax.jit(pinned(fn, args))
    # `placed`: on an auto mesh the traced types hold no shardings; these
    # arguments' do (the batch axes default to the batch's: accum.partition_meta).
    with recording() as record, placed((args, kwargs)):
        lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile(compiler_options=compiler_options)
    check_compiled(compiled.as_text(), on_tag_lost, record)
    return compiled
