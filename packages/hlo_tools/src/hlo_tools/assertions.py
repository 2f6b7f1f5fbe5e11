"""The assertion every package's tests make: gradients are reduced once per step."""

from __future__ import annotations

from hlo_tools.collectives import REDUCTION_KINDS, Collective, collectives
from hlo_tools.module import HloModule
from hlo_tools.parser import parse

# The JAX name scope accum puts on the per-layer reductions it issues inside the
# last microbatch's backward layer scan (the overlapped schedules): each layer's
# final gradient, reduced once, while the earlier layers still compute.
OVERLAPPED_SCOPE = "overlapped_gradient_reduction"


def is_ring_reduction(c: Collective) -> bool:
    """A collective-permute of a ring reduce-scatter accum issues under
    ``OVERLAPPED_SCOPE`` (accum.ring: n-1 permutes of one shard each)."""
    return c.kind == "collective-permute" and OVERLAPPED_SCOPE in c.op_name


def is_gradient_reduction(c: Collective, max_in_loop_elements: int = 8) -> bool:
    """A cross-replica all-reduce or reduce-scatter over more than ``max_in_loop_elements``
    elements: what a gradient reduction compiles to (a loss or a count is smaller);
    or a ring reduce-scatter's collective-permute (`is_ring_reduction`)."""
    if c.elements <= max_in_loop_elements:
        return False
    # A ring's permutes are reductions too: one inside the microbatch loop would
    # be a per-microbatch reduction like any all-reduce there.
    return (c.kind in REDUCTION_KINDS and c.cross_replica) or is_ring_reduction(c)


def _overlapped_loops(records: list[Collective]) -> set[str]:
    """The loops holding a scoped reduction: the last microbatch's backward layer
    scans. One enclosing loop only: they run after the microbatch loop, never in it."""
    return {c.loops[0].name for c in records if OVERLAPPED_SCOPE in c.op_name and len(c.loops) == 1}


def _split_in_loop(
    module: HloModule | str, max_in_loop_elements: int
) -> tuple[list[Collective], list[Collective]]:
    """(overlapped, other) gradient-sized reductions inside loops. A reduction in
    an overlapped loop counts as overlapped even without the scope in its op_name:
    XLA's combiner may merge several into one op and keep another op's name."""
    inside = [
        c
        for c in collectives(module)
        if is_gradient_reduction(c, max_in_loop_elements) and c.in_loop
    ]
    loops = _overlapped_loops(inside)
    overlapped = [c for c in inside if len(c.loops) == 1 and c.loops[0].name in loops]
    return overlapped, [c for c in inside if c not in overlapped]


def overlapped_reductions(
    module: HloModule | str, max_in_loop_elements: int = 8
) -> list[Collective]:
    """Gradient reductions of the last microbatch's backward layer scan (a loop, not
    nested in another, holding reductions under ``OVERLAPPED_SCOPE``): once per step
    in total, one layer per iteration (accum pipelines them by one layer: layer 0's
    runs after the scan), so they can overlap the remaining backward."""
    return _split_in_loop(module, max_in_loop_elements)[0]


def in_loop_reductions(module: HloModule | str, max_in_loop_elements: int = 8) -> list[Collective]:
    """Cross-replica all-reduces/reduce-scatters (and ring reductions'
    collective-permutes, `is_ring_reduction`) inside a while loop with more than
    ``max_in_loop_elements`` elements: the per-microbatch (or per-layer) gradient
    reductions that deferred reduction should have removed. Small ones (a loss
    or a token count) are allowed, and so are `overlapped_reductions` (each
    gradient's one reduction, issued layer by layer after the microbatch loop).

    >>> [(c.name, c.loop_path) for c in ht.in_loop_reductions(HLO)]
    [('r', '%loop(x4)')]
    """
    return _split_in_loop(module, max_in_loop_elements)[1]


def gradient_reductions_outside(
    module: HloModule | str, max_in_loop_elements: int = 8
) -> list[Collective]:
    """Gradient reductions (`is_gradient_reduction`: cross-replica all-reduces/
    reduce-scatters with more than ``max_in_loop_elements`` elements, ring
    permutes) outside every loop: where the deferred gradient reduction lands."""
    return [
        c
        for c in collectives(module)
        if not c.in_loop and is_gradient_reduction(c, max_in_loop_elements)
    ]


def assert_reduced_once_per_step(
    text: HloModule | str, max_in_loop_elements: int = 8
) -> list[Collective]:
    """Assert that no gradient-sized reduction runs inside a loop, and that one runs outside.

    Fails (``AssertionError``) when a cross-replica all-reduce or
    reduce-scatter with more than ``max_in_loop_elements`` elements sits inside
    any while loop; the message lists every one with its op_name, type, loop
    path and executions per step so the model line can be found. Also fails
    when no such reduction exists outside the loops (vacuity guard: a program
    with no gradient reduction at all proves nothing). Returns the reductions
    found outside the loops.

    >>> ht.assert_reduced_once_per_step(HLO)
    Traceback (most recent call last):
    ...
    AssertionError: 1 reduction(s) larger than 8 elements run inside a loop ...
    """
    module = parse(text) if isinstance(text, str) else text
    offenders = in_loop_reductions(module, max_in_loop_elements)
    if offenders:
        lines = [
            f"{len(offenders)} reduction(s) larger than {max_in_loop_elements} elements "
            "run inside a loop (expected once per step, after the loop):"
        ]
        for c in offenders:
            times = "?" if c.multiplier is None else c.multiplier
            lines.append(
                f"  {c.kind} {c.type_str} x{times}/step  loops: {c.loop_path}  "
                f"op_name: {c.op_name or '<none>'}  (%{c.name} in %{c.computation}, "
                f"line {c.line_number})"
            )
        raise AssertionError("\n".join(lines))
    outside = gradient_reductions_outside(module, max_in_loop_elements)
    outside += overlapped_reductions(module, max_in_loop_elements)
    if not outside:
        raise AssertionError(
            f"vacuous: no all-reduce or reduce-scatter larger than {max_in_loop_elements} "
            "elements outside the loops; the program reduces no gradient, so "
            "'reduced once per step' proves nothing"
        )
    return outside
