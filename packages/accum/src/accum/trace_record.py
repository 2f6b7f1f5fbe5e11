"""What tracing an accumulation learned, kept until its compiled program is judged.

Every accumulation (`accumulate_gradients`, `accum.add`) registers one
`TraceRecord` under a number and wraps its loop (or body) in the name scope
`accum_trace[<number>]`, which XLA keeps in the op_name of every instruction
inside. The compiled verdict (accum.verdict) reads the number back out of the
compiled text and finds the record: the plan the step used and each
gradient's shapes and source lines, so it names the parameter even when JAX
reused a cached trace (a step called once before, or checked twice), where no
tracing happens during `compile_checked`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax

TRACE_SCOPE = "accum_trace"
_TRACE_MARK = re.compile(rf"{TRACE_SCOPE}\[(\d+)\]")
# Records of recent traces; old ones are dropped (a long-lived process traces many steps).
_KEEP = 256


@dataclasses.dataclass
class TraceRecord:
    """What tracing one accumulation learned, for the error message: each
    gradient's global and per-device shapes (a gradient resharded onto a
    replicated spec is reduced whole), the trace-time analysis's suspects, and
    the reduction plans the step used (by trace number)."""

    shapes: dict[str, set[tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # Each parameter as the user wrote it (dtype and global shape, e.g. "float32[8,16]"):
    # the one-line TagLostError names it so, not by the reduced array's (maybe transposed) type.
    written: dict[str, str] = dataclasses.field(default_factory=dict)
    suspects: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    dropped: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # forward tag drops
    # (source lines, primitive) of each backward equation a gradient flows through;
    # source lines: (file basename, line) of the innermost user frames.
    lines: dict[str, set[tuple]] = dataclasses.field(default_factory=dict)
    plans: dict[int, Any] = dataclasses.field(default_factory=dict)
    # Trace numbers of `accum.add` bodies (the others are microbatch loops): an
    # op XLA hoists out of a loop keeps the loop's trace number in its op_name.
    adds: set[int] = dataclasses.field(default_factory=set)
    # True under `compile_checked`: the trace-time analysis reports here instead of warning.
    checked: bool = True


_RECORDING = threading.local()
_REGISTRY: collections.OrderedDict[int, TraceRecord] = collections.OrderedDict()
_COUNTER = itertools.count(1)
_LOCK = threading.Lock()


@contextlib.contextmanager
def recording() -> Iterator[TraceRecord]:
    """Collect what accumulations traced inside this block learn; while it is
    open the trace-time analysis reports to it instead of warning."""
    record = TraceRecord()
    previous = getattr(_RECORDING, "record", None)
    _RECORDING.record = record
    try:
        yield record
    finally:
        _RECORDING.record = previous


def active_record() -> TraceRecord | None:
    """The record of the enclosing `recording()` or `traced()` block, None outside one."""
    return getattr(_RECORDING, "record", None)


@contextlib.contextmanager
def traced(plan: Any, kind: str = "loop") -> Iterator[int]:
    """Register the enclosing record (a fresh, unchecked one outside
    `compile_checked`) under a new number, note `plan` (and whether the block
    is an `accum.add` body, `kind="add"`) in it, and open the name scope
    `accum_trace[<number>]` around the block."""
    outer = active_record()
    record = outer if outer is not None else TraceRecord(checked=False)
    with _LOCK:
        number = next(_COUNTER)
        _REGISTRY[number] = record
        while len(_REGISTRY) > _KEEP:
            _REGISTRY.popitem(last=False)
    record.plans[number] = plan
    if kind == "add":
        record.adds.add(number)
    _RECORDING.record = record
    try:
        with jax.named_scope(f"{TRACE_SCOPE}[{number}]"):
            yield number
    finally:
        _RECORDING.record = outer


def trace_number(op_name: str) -> int | None:
    """The innermost `accum_trace[<number>]` in an op_name, None without one."""
    found = _TRACE_MARK.findall(op_name or "")
    return int(found[-1]) if found else None


def records_in(text: str) -> dict[int, TraceRecord]:
    """{number: record} of every registered trace the compiled `text` names."""
    numbers = {int(n) for n in _TRACE_MARK.findall(text)}
    with _LOCK:
        return {n: _REGISTRY[n] for n in sorted(numbers) if n in _REGISTRY}


def is_add(number: int | None) -> bool:
    """Whether trace `number` is a registered `accum.add` body."""
    with _LOCK:
        record = _REGISTRY.get(number)
    return record is not None and number in record.adds


def merged(records: list[TraceRecord]) -> TraceRecord | None:
    """One record holding what all of `records` hold (None for none)."""
    unique = list({id(r): r for r in records}.values())
    if not unique:
        return None
    if len(unique) == 1:
        return unique[0]
    out = TraceRecord()
    for r in unique:
        out.written.update(r.written)
        for name in ("shapes", "lines"):
            for k, v in getattr(r, name).items():
                getattr(out, name).setdefault(k, set()).update(v)
        for name in ("suspects", "dropped"):
            for k, v in getattr(r, name).items():
                getattr(out, name).setdefault(k, []).extend(v)
        out.plans.update(r.plans)
        out.adds |= r.adds
    return out


def record_params(params: Any) -> None:
    """Note each parameter's global and per-device gradient shapes (blame by shape)."""
    record = active_record()
    if record is None:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        aval = jax.typeof(leaf)
        sharding = getattr(aval, "sharding", None)
        try:
            local = tuple(sharding.shard_shape(aval.shape))
        except (AttributeError, TypeError, ValueError):
            local = tuple(aval.shape)
        name = jax.tree_util.keystr(path)
        record.shapes[name] = {local, tuple(aval.shape)}
        record.written[name] = f"{aval.dtype.name}[{','.join(map(str, aval.shape))}]"
