"""The assertion every package's tests make: gradients are reduced once per step."""

from __future__ import annotations

from hlo_tools.collectives import REDUCTION_KINDS, Collective, collectives
from hlo_tools.module import HloModule
from hlo_tools.parser import parse


def in_loop_reductions(module: HloModule | str, max_in_loop_elements: int = 8) -> list[Collective]:
    """Cross-replica all-reduces/reduce-scatters inside a while loop with more than
    ``max_in_loop_elements`` elements: the per-microbatch (or per-layer) gradient
    reductions that deferred reduction should have removed. Small ones (a loss
    or a token count) are allowed."""
    return [
        c
        for c in collectives(module)
        if c.kind in REDUCTION_KINDS
        and c.in_loop
        and c.cross_replica
        and c.elements > max_in_loop_elements
    ]


def gradient_reductions_outside(
    module: HloModule | str, max_in_loop_elements: int = 8
) -> list[Collective]:
    """Cross-replica all-reduces/reduce-scatters outside every loop with more than
    ``max_in_loop_elements`` elements: where the deferred gradient reduction lands."""
    return [
        c
        for c in collectives(module)
        if c.kind in REDUCTION_KINDS
        and not c.in_loop
        and c.cross_replica
        and c.elements > max_in_loop_elements
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
    if not outside:
        raise AssertionError(
            f"vacuous: no all-reduce or reduce-scatter larger than {max_in_loop_elements} "
            "elements outside the loops; the program reduces no gradient, so "
            "'reduced once per step' proves nothing"
        )
    return outside
