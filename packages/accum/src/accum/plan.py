"""The reduction plan: for every parameter leaf and batch mesh axis, when its gradient is reduced.

This file is the only place that decides it. Everything else reads the plan:
accumulation (`accumulate_gradients`, `start`/`add`/`finish`, ZeRO-1), the
trainer's tagging and startup report, the HLO verdict, AOT and the benches.

A weight's gradient contracts over every token, so it is a per-device partial
sum over each mesh axis that shards the tokens (the batch axes). Per leaf and
batch axis the plan says when that sum is taken:

- `PER_USE`: inside the model, per use. The leaf is sharded over the axis
  (FSDP gathers it per use, the expert shard_map sums over 'expert'), so the
  transpose of the gather (a reduce-scatter) or the kernel reduces it.
  `reduced_at_use` gives the tag of such a gathered copy.
- `PER_MICROBATCH`: in each microbatch's backward pass, where JAX puts it
  (the leaf is left untagged over the axis).
- `SCATTER`: after each microbatch's backward pass, by accum, reduce-scattered
  into an accumulator sharded over the axis (ZeRO-2 style; hierarchical).
- `PER_STEP`: once per optimizer step: the accumulator stays unreduced over the
  axis and the one reduction runs after the microbatch loop.
- `BY_XLA`: auto mode; no tags, XLA places the reduction.

Policies: `deferred` (every batch axis once per step), `per_microbatch`
(every batch axis in the backward pass), `hierarchical` (cross-slice axes once
per step, in-slice ones reduce-scattered per microbatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum.shards import add_axes_to_free_dims
from pspec_tags import mesh_axes_used, partitions, reduced_axes, spec_of, untagged

POLICIES = ("deferred", "per_microbatch", "hierarchical")
PATHS = ("auto", "tags", "local")

PER_USE = "per use"
PER_MICROBATCH = "per microbatch"
SCATTER = "per microbatch, reduce-scatter"
PER_STEP = "once per step"
BY_XLA = "by XLA"


class PlanError(ValueError):
    """A policy that cannot apply to this mesh (e.g. hierarchical without a cross-slice axis)."""


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One parameter leaf's schedule.

    `when` pairs every batch axis (size > 1, in mesh order) with one of the
    constants above. `accumulator_spec` is the untagged partitions of its
    gradient accumulator (the parameter's own unless a `SCATTER` axis shards it).
    """

    when: tuple[tuple[str, str], ...]
    param_spec: P
    accumulator_spec: P

    def axes(self, *whens: str) -> tuple[str, ...]:
        """The batch axes reduced at any of `whens`, in mesh order."""
        return tuple(axis for axis, when in self.when if when in whens)

    @property
    def per_step(self) -> tuple[str, ...]:
        """Axes the accumulator stays unreduced over until after the loop."""
        return self.axes(PER_STEP)

    @property
    def scatter(self) -> tuple[str, ...]:
        """Axes accum reduces (scatters) after each microbatch."""
        return self.axes(SCATTER)

    @property
    def tagged(self) -> tuple[str, ...]:
        """Axes the compute parameter is tagged `reduced` over: its per-microbatch
        gradient comes out unreduced over them, for accum to reduce."""
        return self.axes(PER_STEP, SCATTER)

    @property
    def accumulator_target(self) -> P:
        """The accumulator's full type: its partitions, unreduced over `per_step`."""
        if not self.per_step:
            return self.accumulator_spec
        # TAG: the carry's type: unreduced over the per-step axes, so adding a microbatch
        # moves nothing and the one reduction waits for the end of the step.
        return P(*partitions(self.accumulator_spec), unreduced=set(self.per_step))


def _is_leaf_plan(x: Any) -> bool:
    return isinstance(x, LeafPlan)


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
    """The schedule of every gradient reduction of a step (see the module docstring)."""

    policy: str
    mode: str
    mesh_shape: tuple[tuple[str, int], ...]
    batch_axes: tuple[str, ...]
    slice_axes: tuple[str, ...]
    treedef: Any  # the parameters' tree structure
    leaf_list: tuple[LeafPlan, ...]  # flattened, so the plan hashes (a static jit argument)
    # How gradients stay per-device sums (accum.paths): "tags" (reduced/unreduced
    # types), "local" (each microbatch inside a shard_map over the batch axes) or
    # "auto" (chosen when accumulating); `path_reason` says why.
    path: str = "tags"
    path_reason: str = ""
    gated_by: tuple[str, ...] = ()  # parameters whose sharding made a batch axis per microbatch

    @property
    def leaves(self) -> Any:
        """The LeafPlans in the parameters' structure."""
        return jax.tree.unflatten(self.treedef, self.leaf_list)

    def leaf_plans(self) -> list[LeafPlan]:
        return list(self.leaf_list)

    def map(self, fn: Any, *trees: Any) -> Any:
        """`jax.tree.map(fn, leaf_plan, *leaves)` over the parameters' structure."""
        return jax.tree.map(fn, self.leaves, *trees, is_leaf=_is_leaf_plan)

    def axes(self, *whens: str) -> tuple[str, ...]:
        """Batch axes some leaf reduces at one of `whens` (mesh order)."""
        hit = {a for leaf in self.leaf_plans() for a in leaf.axes(*whens)}
        return tuple(a for a in self.batch_axes if a in hit)

    @property
    def tagged_axes(self) -> tuple[str, ...]:
        """Axes some compute parameter is tagged reduced over (the guard checks these)."""
        return self.axes(PER_STEP, SCATTER)

    @property
    def fused_applies(self) -> bool:
        """Whether the fused schedule (accum.schedule) fuses: everywhere but a plan
        whose only batch-axis reductions are autodiff's per-microbatch ones (explicit
        mode, nothing tagged, some axis reduced per microbatch). There autodiff
        reduces each layer's gradient inside the backward scan anyway, and fusing
        the addition let XLA:TPU move those reductions out of the scan onto a
        full-size stacked gradient, raising the step's memory (the plain path's
        figure: benchmarks/results/aot_scale.md, "untagged"; commit 5806d5f compares
        it with the fused one). Without batch axes to reduce (one device, or a mesh
        of model axes only) nothing moves, and fusing still saves the
        per-microbatch gradient buffer; auto mode leaves the reductions to XLA."""
        if self.mode != "explicit" or self.tagged_axes:
            return True
        return not self.axes(PER_MICROBATCH)

    @property
    def deferred_axes(self) -> tuple[str, ...]:
        """Axes some leaf reduces once per step."""
        return self.axes(PER_STEP)

    @property
    def strict_axes(self) -> tuple[str, ...]:
        """Axes every leaf reduces once per step: an in-loop gradient reduction
        spanning one of them is a FAIL. In-loop reductions over the other batch
        axes (FSDP's reduce-scatters, hierarchical's in-slice ones) are by design."""
        others = set(self.axes(PER_USE, PER_MICROBATCH, SCATTER, BY_XLA))
        return tuple(a for a in self.deferred_axes if a not in others)

    @property
    def scatters(self) -> bool:
        return bool(self.axes(SCATTER))

    def summary(self) -> str:
        """One line: the policy and which axes are reduced when."""
        if not self.batch_axes:
            return "nothing to defer (no mesh axis shards the tokens)"
        why = f" ({self.path_reason})" if self.path_reason else ""
        if self.path == "local":
            return (
                f"local path: each microbatch in a shard_map over {self.batch_axes}, gradients "
                f"summed per device, reduced once per step{why}"
            )
        if self.mode != "explicit":
            return (
                "placed by XLA: every gradient reduced per microbatch (auto mode carries no "
                f"reduced/unreduced tags; path='local' defers){why}"
            )
        return self._tags() + why

    def _tags(self) -> str:
        """The summary of the tags path."""
        if self.policy == "per_microbatch":
            return f"per microbatch over {self.batch_axes} (policy per_microbatch)"
        per_use = self.axes(PER_USE)
        also = f"; per use over {per_use} (sharded weights)" if per_use else ""
        if self.policy == "hierarchical":
            return (
                f"hierarchical: once per step over {self.deferred_axes} across slices; "
                f"reduce-scattered per microbatch over {self.axes(SCATTER)} into sharded "
                f"accumulators{also}"
            )
        if not self.deferred_axes:
            by = ", ".join(self.gated_by[:3]) + (" ..." if len(self.gated_by) > 3 else "")
            return (
                f"defers nothing: every gradient reduced per microbatch over {self.batch_axes}, "
                f"because parameter(s) {by} are sharded over them (per_parameter=True defers "
                "the others; path='local' defers all)"
            )
        gated = self.axes(PER_MICROBATCH)
        also += (
            f"; per microbatch over {gated} for all, because {', '.join(self.gated_by[:3])} "
            "are sharded over them"
            if gated and self.gated_by
            else ""
        )
        return f"deferred to once per step over {self.deferred_axes} (grads stay unreduced){also}"

    def table(self, group_depth: int = 2) -> list[str]:
        """Parameter groups (paths cut to `group_depth` keys) x batch axes -> when."""
        groups: dict[str, set[tuple[str, str]]] = {}
        flat, _ = jax.tree_util.tree_flatten_with_path(self.leaves, is_leaf=_is_leaf_plan)
        for path, leaf in flat:
            keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            groups.setdefault("/".join(keys[:group_depth]) or "<params>", set()).update(leaf.when)
        header = ["parameters", *self.batch_axes]
        rows = [
            [
                name,
                *(" / ".join(sorted(w for a, w in whens if a == axis)) for axis in self.batch_axes),
            ]
            for name, whens in sorted(groups.items())
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
        lines = [fmt(header), *(fmt(r) for r in rows)]
        if self.path == "local" or self.path_reason:
            lines.insert(
                0, f"path: {self.path}" + (f" ({self.path_reason})" * bool(self.path_reason))
            )
        return lines


def _spec_and_shape(leaf: Any) -> tuple[P, tuple[int, ...]]:
    """The leaf's PartitionSpec (P() when it has none) and shape."""
    spec = spec_of(leaf)
    sharding = getattr(leaf, "sharding", None)
    if spec is None and isinstance(sharding, NamedSharding):
        spec = sharding.spec
    return untagged(spec if spec is not None else P()), tuple(getattr(leaf, "shape", ()))


def is_floating(leaf: Any) -> bool:
    """Whether `leaf` (array, tracer, ShapeDtypeStruct) has an inexact dtype: a
    gradient worth accumulating. Anything without a dtype is not floating."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def accumulator_dtype(leaf: Any, accum_dtype: Any) -> Any:
    """The dtype `leaf`'s gradient is accumulated in: `accum_dtype` for a real floating
    leaf (narrower than the leaf's own where asked: a bf16 accumulator for f32 weights
    is a memory choice); for a complex leaf `accum_dtype` promoted with its own, so the
    imaginary part is kept (a real accumulator dropped it); a leaf's own dtype
    otherwise or where `accum_dtype` is None."""
    own = jnp.result_type(leaf)
    if accum_dtype is None or not is_floating(leaf):
        return own
    if jnp.issubdtype(own, jnp.complexfloating):
        return jnp.promote_types(accum_dtype, own)
    return jnp.dtype(accum_dtype)


def _when(
    axis: str,
    used: set[str],
    policy: str,
    mode: str,
    sliced: set[str],
    gated: set[str],
    path: str = "tags",
) -> str:
    """The one decision: when `axis`'s partial sums of a leaf sharded over `used` are reduced."""
    if path == "local":  # gathered at the shard_map's entry; summed per device
        return PER_STEP
    if mode != "explicit":
        return BY_XLA
    if axis in used:
        return PER_USE
    if policy == "per_microbatch" or axis in gated:
        return PER_MICROBATCH
    if policy == "hierarchical" and axis not in sliced:
        return SCATTER
    return PER_STEP


def make_plan(
    params: Any,
    *,
    batch_axes: Iterable[str],
    mesh_shape: Mapping[str, int],
    policy: str = "deferred",
    mode: str = "explicit",
    slice_axes: Iterable[str] = (),
    per_parameter: bool = True,
    path: str = "tags",
) -> ReductionPlan:
    """The reduction plan of `params` (arrays or ShapeDtypeStructs with shardings:
    the layout the model computes with, not ZeRO-1's masters).

    `batch_axes`: mesh axes that shard the tokens; `mesh_shape`: the ordered
    axis sizes; `slice_axes`: mesh axes whose devices sit in different slices
    (over DCN). `per_parameter=True`: a leaf sharded over a batch axis reduces
    it per use and defers the others (the model gathers such leaves with a
    tagged reshard, or consumes them in a shard_map); False: a batch axis that
    shards any parameter is reduced per microbatch for all (plain matmuls).
    `path`: "tags" (default), "local" (each microbatch in a shard_map over the
    batch axes: any model, auto meshes too) or "auto" (tags, else local,
    decided by `accumulate_gradients`; accum.paths). Raises PlanError for a
    policy that cannot apply.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> plan = accum.make_plan({"w": w}, batch_axes=("data",), mesh_shape=dict(mesh.shape))
    >>> plan.leaves["w"].when, plan.strict_axes
    ((('data', 'once per step'),), ('data',))
    """
    if policy not in POLICIES:
        raise PlanError(f"gradient reduction policy {policy!r} is not one of {POLICIES}")
    if path not in PATHS:
        raise PlanError(f"accumulation path {path!r} is not one of {PATHS}")
    if path == "local" and policy != "deferred":
        raise PlanError(f"the local path defers every batch axis; policy {policy!r} needs tags")
    sizes = dict(mesh_shape)
    batch = tuple(a for a in sizes if a in set(batch_axes) and sizes[a] > 1)
    sliced = {a for a in slice_axes if sizes.get(a, 1) > 1}
    if policy == "hierarchical" and mode != "explicit":
        raise PlanError(
            f"the hierarchical policy needs explicit mode (mode={mode!r} lets XLA place "
            "every reduction)"
        )
    if policy == "hierarchical" and not sliced & set(batch):
        across = tuple(a for a in sizes if a in sliced) or "none"
        raise PlanError(
            "the hierarchical policy needs a cross-slice batch axis (one of slice_axes, of "
            f"size > 1, that shards the batch); batch axes here: {batch or 'none'}, "
            f"cross-slice axes: {across}"
        )
    specs = jax.tree.map(_spec_and_shape, params)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], P)  # noqa: E731
    used_anywhere = {
        a for spec, _ in jax.tree.leaves(specs, is_leaf=is_pair) for a in mesh_axes_used(spec)
    }
    gated = set() if per_parameter or path == "local" else used_anywhere & set(batch)
    gated_by = tuple(
        jax.tree_util.keystr(k)
        for k, (spec, _) in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_pair)[0]
        if set(mesh_axes_used(spec)) & gated
    )

    def plan_leaf(leaf, spec_shape):
        spec, shape = spec_shape
        used = set(mesh_axes_used(spec))
        when = tuple((a, _when(a, used, policy, mode, sliced, gated, path)) for a in batch)
        if not is_floating(leaf):  # integer leaves get no gradient worth reducing
            when = tuple((a, PER_MICROBATCH if w != BY_XLA else w) for a, w in when)
        leaf_plan = LeafPlan(when, spec, spec)
        scatter = leaf_plan.scatter
        if scatter:
            acc = add_axes_to_free_dims(spec, shape, sizes, scatter)
            leaf_plan = dataclasses.replace(leaf_plan, accumulator_spec=acc)
        return leaf_plan

    leaves = jax.tree.map(plan_leaf, params, specs)
    flat, treedef = jax.tree.flatten(leaves, is_leaf=_is_leaf_plan)
    slices = tuple(a for a in sizes if a in sliced)
    return ReductionPlan(
        policy, mode, tuple(sizes.items()), batch, slices, treedef, tuple(flat), path, "", gated_by
    )


def reduced_at_use(source: P | None, target: P | None, batch_axes: Iterable[str]) -> frozenset[str]:
    """The axes a parameter resharded from `source` to `target` for one use (a
    weight gathered before a matmul) is tagged `reduced` over: `make_plan`'s
    `PER_USE` rule, seen from the use.

    A parameter tagged reduced (its gradient deferred or scattered by accum)
    keeps its tag. The batch axes the reshard gathers it over (FSDP: `source`
    sharded over them, `target` not) are added: the gathered copy is identical
    across them, its cotangent comes out unreduced over every batch axis as a
    matmul contracting over the tokens produces, and the transpose of the
    reshard (a reduce-scatter) reduces the gathered axes per use while the
    others stay unreduced for accum. An untagged parameter gets no tag (empty):
    its reductions are JAX's, in the backward pass.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> fsdp_w = P("fsdp", None, reduced={"data"})  # deferred over data, FSDP-sharded
    >>> sorted(accum.reduced_at_use(fsdp_w, P(None, None), ("data", "fsdp")))
    ['data', 'fsdp']
    >>> accum.reduced_at_use(P("fsdp", None), P(None, None), ("data", "fsdp"))
    frozenset()
    """
    tag = reduced_axes(source)
    if not tag:
        return frozenset()
    gathered = set(mesh_axes_used(source)) - set(mesh_axes_used(target))
    return tag | (gathered & set(batch_axes))


def mesh_shape_of(leaves: Iterable[Any]) -> dict[str, int]:
    """The axis sizes of the first leaf with an explicit sharding ({} when none has one)."""
    for leaf in leaves:
        if spec_of(leaf) is not None:
            return dict(jax.typeof(leaf).sharding.mesh.shape)
    return {}
