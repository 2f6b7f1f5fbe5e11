"""The trace-time guard's walk (accum.guard): one pass over a vjp jaxpr that
labels every value with what it depends on (the backward seed, a parameter, the
microbatch) and the deferred-axis reductions it has passed through.

A backward equation that turns a cotangent partial over a deferred axis into one
that is not is a reduction XLA must run inside the loop (`Site`); a forward
equation summing a value computed from the parameters alone over one is blamed
on those parameters; a layout op dropping a parameter's `reduced` tag is noted
as the line where the tag was lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from accum.jaxpr_regions import Region, nested_regions
from accum.jaxpr_types import (
    block_elements,
    contraction_sum_axes,
    dim_axes,
    is_literal,
    manual_axes,
    reduced_over,
    unreduced_over,
    var_spec,
)
from accum.source_lines import user_lines, where
from accum.verdict import MAX_ELEMENTS
from pspec_tags import mesh_axes_used

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
class Site:
    """One backward equation that reduces deferred `axes`."""

    text: str
    axes: frozenset[str]


COTANGENT = "<cotangent>"  # label: the value depends on the backward seed
BATCH = "<batch>"  # label: the value depends on the microbatch (an activation)


def param_label(path: str) -> tuple[str, str]:
    return ("param", path)


def params_in(labels: Iterable) -> list[str]:
    return sorted(lab[1] for lab in labels if isinstance(lab, tuple) and lab[0] == "param")


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
        add(unreduced_over(var), var)
    if name == "dot_general":
        add(contraction_sum_axes(eqn), eqn.invars[0])
    elif name in _REDUCE_PRIMITIVES:
        add(dim_axes(eqn.invars[0], params.get("axes", ())), eqn.invars[0])
    elif name in _SCATTER_ADD and len(eqn.invars) >= 3:
        # Updates sharded over an axis the result is sharded over too (rows
        # scattered back into their own batch-sharded rows: take_along_axis's
        # transpose) add locally; only an axis the result does not shard sums.
        updates = eqn.invars[2]
        local = mesh_axes_used(var_spec(eqn.outvars[0]))
        add(set(mesh_axes_used(var_spec(updates))) - set(local), updates)
    elif name in _MANUAL_REDUCTIONS:
        axes = params.get("axes", params.get("axis_name", ()))
        axes = frozenset(axes if isinstance(axes, tuple | list) else (axes,))
        for var in cotangent_in:
            add(manual_axes(var, "varying") & axes, var)
    return found


class Walker:
    """One forward pass over a vjp jaxpr, propagating labels from inputs to outputs.

    Labels: `COTANGENT` (depends on the backward seed), `("param", path)`
    (depends on that parameter: used to blame forward drops), and `Site`s (a
    deferred-axis reduction this value has passed through).
    """

    def __init__(self, axes: frozenset[str], trace_lines: bool = False):
        self.axes = axes
        # Label each backward value with the source lines it passed through, so
        # the compiled verdict can name the gradients an HLO instruction feeds.
        self.trace_lines = trace_lines
        self.sites: dict[int, Site] = {}  # id(eqn) -> site, stable across loop re-walks
        self.drops: dict[str, list[str]] = {}  # param path -> forward drops
        # param path -> forward reductions of values computed from it
        self.forward: dict[str, list[Site]] = {}

    def walk(self, jaxpr: Any, in_labels: Sequence[frozenset]) -> list[frozenset]:
        env = dict(zip(jaxpr.invars, in_labels, strict=True))
        for eqn in jaxpr.eqns:
            ins = [frozenset() if is_literal(v) else env.get(v, frozenset()) for v in eqn.invars]
            regions = nested_regions(eqn)
            outs = self._nested(eqn, regions, ins) if regions else self._primitive(eqn, ins)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [frozenset() if is_literal(v) else env.get(v, frozenset()) for v in jaxpr.outvars]

    def _primitive(self, eqn: Any, ins: list[frozenset]) -> list[frozenset]:
        union = frozenset().union(*ins)
        if eqn.primitive.name in _LAYOUT_PRIMITIVES:
            self._forward_drop(eqn, eqn.invars[0], eqn.outvars[0], ins[0])
        if COTANGENT in union:
            cotangent_in = [v for v, lab in zip(eqn.invars, ins, strict=True) if COTANGENT in lab]
            union = self._without_resummed(eqn, cotangent_in, union)
            site = self._reduction(eqn, cotangent_in)
            if site is not None:
                union = union | {site}
            if self.trace_lines:
                union = union | {("line", user_lines(eqn), eqn.primitive.name)}
        elif params_in(union) and BATCH not in union:
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
        computed = [v for v, lab in zip(eqn.invars, ins, strict=True) if params_in(lab)]
        site = self._reduction(eqn, computed, "forward")
        if site is None:
            return
        for name in params_in(frozenset().union(*ins)):
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
        kept = frozenset().union(*(unreduced_over(o) for o in eqn.outvars))
        # Partial over an axis no cotangent operand was partial over: this sum
        # (a contraction, or a scatter-add inside shard_map) made it partial.
        resummed = kept - frozenset().union(*(unreduced_over(v) for v in cotangent_in))
        if not resummed:
            return labels
        return frozenset(
            lab for lab in labels if not (isinstance(lab, Site) and lab.axes <= resummed)
        )

    def _nested(self, eqn: Any, regions: list[Region], ins: list[frozenset]) -> list[frozenset]:
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

    def _fixpoint(self, region: Region, sub_in: list[frozenset]) -> list[frozenset]:
        """Walk a region; for loops, feed carried labels back until they settle."""
        while True:
            sub_out = self.walk(region.jaxpr, sub_in)
            grown = list(sub_in)
            for src, dst in region.loop:
                grown[dst] = grown[dst] | sub_out[src]
            if grown == sub_in:
                return sub_out
            sub_in = grown

    def _reduction(self, eqn: Any, inputs: list[Any], pass_: str = "backward") -> Site | None:
        """The site if `eqn` sums one of `inputs` (cotangents, or in the forward
        pass values computed from the parameters) over a deferred axis into more
        than MAX_ELEMENTS elements per device, else None. Smaller sums (a loss,
        a count) are what the compiled verdict lets pass too."""
        partial = _partial_axes(eqn, inputs)
        kept = frozenset().union(*(unreduced_over(o) for o in eqn.outvars))
        lost = sorted(a for a in partial if a in self.axes and a not in kept)
        if not lost or max(block_elements(o) for o in eqn.outvars) <= MAX_ELEMENTS:
            return None
        if id(eqn) not in self.sites:
            src = partial[lost[0]]
            self.sites[id(eqn)] = Site(
                f"{eqn.primitive.name}: {src.aval} -> {eqn.outvars[0].aval} reduces "
                f"{lost} in the {pass_} pass of {where(eqn)}",
                frozenset(lost),
            )
        return self.sites[id(eqn)]

    def _forward_drop(self, eqn: Any, src: Any, dst: Any, labels: frozenset) -> None:
        lost = sorted((reduced_over(src) & self.axes) - reduced_over(dst))
        if not lost:
            return
        what = (
            f"{eqn.primitive.name}: {src.aval} -> {dst.aval} drops reduced {lost} at {where(eqn)}"
        )
        for name in params_in(labels):
            if what not in self.drops.setdefault(name, []):
                self.drops[name].append(what)
