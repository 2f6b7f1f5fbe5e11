"""Mesh, logical axis rules, and the one object model code shards through.

The model never builds a PartitionSpec itself: it names logical axes and asks a
`ShardCtx`, so explicit and auto mode run the same code. Specs built here are
untagged by construction (logical rules know nothing of `reduced`); wherever a
*parameter* is resharded, the caller carries its tag back with
`pspec_tags.carry_reduced_axes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import pspec_tags as pt
from trainer.config import (
    DCN_AXES,
    MESH_AXES,
    STAGE_AXIS,
    AccumulationConfig,
    ConfigError,
    ParallelismConfig,
)
from trainer.sharding.slices import device_array, slice_axes


def make_mesh(
    sizes: dict[str, int],
    mode: str,
    devices: Sequence[Any] | None = None,
    dcn: Mapping[str, int] | None = None,
) -> Mesh:
    """Every mesh axis (size one when unused or absent from `sizes`), Explicit or Auto.

    The cross-slice (dcn_) axes come first and each slice is one block along them
    (`slices.device_array`: the hybrid mesh on devices that report their slice,
    slice-major order otherwise); `dcn` (config.dcn_parts): the cross-slice parts
    of the 'stage' and 'expert' axes, laid out major within each.
    """
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    if devices is None:
        shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
        return jax.make_mesh(shape, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES))
    array = device_array(sizes, devices, dcn)
    return Mesh(array, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES))


def logical_rules(parallelism: ParallelismConfig) -> tuple[tuple[str, Any], ...]:
    """Logical axis -> mesh axes. The first usable rule for a name wins (pspec_tags)."""
    expert_in_batch = parallelism.expert_shard_attention_option == "fsdp"
    # The batch splits across slices first (dcn_ axes), then inside one.
    dcn = ("dcn_data", "dcn_fsdp")
    batch = (*dcn, "data", "fsdp", "expert") if expert_in_batch else (*dcn, "data", "fsdp")
    length = ("context",) if expert_in_batch else ("context", "expert")
    return (
        # Activations.
        ("activation_batch", batch),
        ("activation_length", length),
        ("activation_kv_length", None),  # keys/values gathered over the sequence shards
        ("activation_embed", "tensor_transpose"),
        ("activation_heads", "tensor"),
        ("activation_mlp", "tensor"),
        ("activation_vocab", "tensor"),
        ("activation_exp", "expert"),
        ("activation_lora", None),
        ("activation_head_dim", None),
        # Weights.
        ("vocab", "tensor"),
        ("embed", ("dcn_fsdp", "fsdp", "tensor_transpose")),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("exp", "expert"),
        ("q_lora", None),
        ("kv_lora", None),
        ("head_dim", None),
        ("norm", None),
        ("layers", None),
        # The MoE layers' stack: its layer dim split into the pipeline's stages.
        ("stage_layers", STAGE_AXIS),
    )


CTX_MODES = (*pt.MODES, "manual")
# Mesh axes a manual region's einsums may split a contraction over (ShardCtx.einsum):
# 'tensor', as inside the pipeline's stages (model/pipeline.py).
SPLIT_AXES = ("tensor",)


@dataclasses.dataclass(frozen=True)
class ShardCtx:
    """Mesh + rules + mode: turns logical axis names into shardings.

    Modes: 'explicit' and 'auto' are the trainer's `shard_mode`s. 'manual' is
    for model code running per device inside a `jax.shard_map` that already
    made every mesh axis manual (the hand-written floor step, trainer.run.floor):
    there is nothing left to shard, so constraints, weight gathers and
    out_shardings are skipped and the MoE layer runs unsharded.
    """

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]
    mode: str
    # Microbatches through the pipeline per step (model/pipeline.py): used only
    # where the mesh has a 'stage' axis of size > 1.
    pipeline_microbatches: int = 1
    pipeline_repeats: int = 1  # layer chunks per stage (> 1: circular stages)
    # The cross-slice part of the 'stage' and 'expert' axes ((axis, size) pairs,
    # config.dcn_parts): the expert axis crosses slices when its part is > 1, and
    # then counts among the plan's slice axes (slices.slice_axes).
    dcn_parts: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if self.mode not in CTX_MODES:
            raise ValueError(f"ShardCtx mode {self.mode!r} is not one of {CTX_MODES}")

    @property
    def explicit(self) -> bool:
        return self.mode == "explicit"

    @property
    def manual(self) -> bool:
        return self.mode == "manual"

    def spec(self, logical: Sequence[str | None], shape: Sequence[int] | None = None) -> P:
        """Untagged spec for `logical`; with `shape`, axes that don't divide are dropped."""
        spec = pt.logical_to_spec(logical, self.rules, self.mesh)
        return spec if shape is None else pt.fit_to_shape(spec, shape, self.mesh)

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def act(self, x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
        """Constrain an activation (never a parameter: that would drop its tag)."""
        if self.manual:
            return x
        # TAG: activations only: a rebuilt, untagged spec is right for them.
        return pt.shard(x, self.spec(logical, x.shape), self.mode)

    def relayout(
        self, x: jax.Array, source: Sequence[str | None], target: Sequence[str | None]
    ) -> jax.Array:
        """An activation laid out as `source` moved to `target` (the keys and values
        gathered whole along the sequence for attention, the MTP shift's token ids).

        Explicit and auto: `act(x, target)` (the partitioner moves the data). Manual
        (every axis manual: the pipeline's stages and ends): each dim's mesh axes
        `source` places and `target` does not are all-gathered along it, and those
        `target` places and `source` does not are sliced to this device's part (a
        value whole over them). The all-gather's transpose sums the cotangent's
        pieces back (a reduce-scatter), the slice's pads them.
        """
        if not self.manual:
            return self.act(x, target)
        sizes = dict(self.mesh.shape)
        have = pt.partitions(self.spec(source))
        want = pt.partitions(self.spec(target))
        for dim in range(x.ndim):
            had = list(pt.entry_axes(have[dim] if dim < len(have) else None))
            wanted = list(pt.entry_axes(want[dim] if dim < len(want) else None))
            if had == wanted:
                continue
            if wanted[: len(had)] != had and had[: len(wanted)] != wanted:
                raise ValueError(
                    f"relayout of dim {dim}: {had} to {wanted} is neither a gather nor a slice"
                )
            if len(had) > len(wanted):
                gone = [a for a in had[len(wanted) :] if sizes.get(a, 1) > 1]
                if gone:
                    x = lax.all_gather(x, pt.entry_from_axes(gone), axis=dim, tiled=True)
            else:
                new = [a for a in wanted[len(had) :] if sizes.get(a, 1) > 1]
                if new:
                    parts = math.prod(sizes[a] for a in new)
                    index = lax.axis_index(pt.entry_from_axes(new))
                    size = x.shape[dim] // parts
                    x = lax.dynamic_slice_in_dim(x, index * size, size, dim)
        return x

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes (size > 1) that shard the tokens: the batch and the sequence.

        A weight's gradient contracts over every token, so these are the axes
        its per-device partial sums are unreduced over.
        """
        spec = pt.logical_to_spec(("activation_batch", "activation_length"), self.rules, self.mesh)
        return pt.mesh_axes_used(spec)

    def param(self, w: jax.Array, logical: Sequence[str | None]) -> jax.Array:
        """Reshard a parameter to `logical`, keeping its reduced tag (and extending it).

        The rebuilt spec is untagged; without `carry_reduced_axes` a reduced
        parameter would land on it as a plain replicated value and its gradient
        would be all-reduced right here, once per microbatch. When the reshard
        gathers a tagged parameter over token axes (FSDP), the gathered copy is
        identical across them, so it is tagged reduced over those too: its
        cotangent is then unreduced over every batch axis, which is what a
        matmul contracting over the batch produces, and the transpose of this
        reshard is the FSDP reduce-scatter, leaving 'data' unreduced. That rule is
        the reduction plan's (`accum.reduced_at_use`); this only applies it.
        """
        if self.manual:
            return w
        return self._reshard_param(w, self.spec(logical, w.shape))

    def _reshard_param(self, w: jax.Array, target: P) -> jax.Array:
        source = pt.spec_of(w)
        if not self.explicit or source is None or not pt.reduced_axes(source):
            # TAG: carry w's reduced axes onto the rebuilt target, or this reshard
            # all-reduces the deferred gradient once per use.
            return pt.shard(w, pt.carry_reduced_axes(target, w), self.mode)
        # TAG: the plan's per-use rule (accum.reduced_at_use): reduced over the gathered
        # token axes too, so FSDP's reduce-scatter stays per use and the other batch
        # axes stay deferred (JAX rejects a subset).
        tag = accum.reduced_at_use(source, target, self.token_axes)
        return jax.reshard(w, pt.with_reduced(target, tag))

    def weight(self, w: jax.Array, logical: Sequence[str | None]) -> jax.Array:
        """A weight in the layout a matmul uses it: its logical spec minus the token axes.

        Only tagged weights (deferred reduction) are gathered here, via `param`;
        untagged ones are left to the einsum, as XLA gathers them anyway.
        """
        source = pt.spec_of(w)
        if not self.explicit or source is None or not pt.reduced_axes(source):
            return w
        batch = set(self.token_axes)
        spec = self.spec(logical, w.shape)
        entries = []
        for entry in pt.partitions(spec):
            entries.append(pt.entry_from_axes([a for a in pt.entry_axes(entry) if a not in batch]))
        if list(pt.partitions(source)) == entries:
            return w
        return self._reshard_param(w, P(*entries))

    def einsum(self, equation: str, *operands: jax.Array, out: Sequence[str | None]) -> jax.Array:
        """`jnp.einsum` whose output lands on the logical sharding `out`.

        Explicit mode passes `out_sharding` (the type system needs to know where a
        contraction over a sharded dim lands); auto mode cannot name Auto axes
        there, so it constrains the result instead.
        """
        if self.manual:
            return self._sum_split(jnp.einsum(equation, *operands), out)
        if self.explicit:
            out_shape = _einsum_out_shape(equation, operands)
            # TAG: explicit mode must name where a contraction over a sharded dim
            # lands (JAX raises otherwise); an untagged logical spec suits activations.
            return jnp.einsum(equation, *operands, out_sharding=self.spec(out, out_shape))
        return self.act(jnp.einsum(equation, *operands), out)

    def _sum_split(self, y: jax.Array, out: Sequence[str | None]) -> jax.Array:
        """Manual mode: `y` summed over each SPLIT_AXES axis it varies over but `out`
        does not place on a dim. Only a contraction over a dim split over that axis
        (attention's output projection over its heads) makes such a value: each
        device holds a partial sum. A value split over it on one of `out`'s dims (a
        head-split projection) is a shard, left alone; an invariant one is whole."""
        sizes = dict(self.mesh.shape)
        # No shape given: the logical spec as mapped, whatever the local shape (a
        # local dim need not divide again by the axis it is already split over).
        placed = pt.mesh_axes_used(self.spec(out))
        axes = tuple(
            a
            for a in SPLIT_AXES
            if sizes.get(a, 1) > 1 and a in pt.varying_axes(y) and a not in placed
        )
        # Forward: Megatron's all-reduce after the row-split matmul. Its transpose
        # moves nothing; the column-split matmul's implicit cast to varying (its
        # invariant input meeting a split weight) psums the input's cotangent.
        return lax.psum(y, axes) if axes else y


def _einsum_out_shape(equation: str, operands: Sequence[jax.Array]) -> tuple[int, ...]:
    """Output shape of an explicit-output einsum like 'bsd,dh->bsh' (no ellipsis)."""
    inputs, _, output = equation.replace(" ", "").partition("->")
    dims: dict[str, int] = {}
    for letters, operand in zip(inputs.split(","), operands, strict=True):
        dims.update(zip(letters, operand.shape, strict=True))
    return tuple(dims[letter] for letter in output)


def reduction_plan(
    parallelism: ParallelismConfig, accumulation: AccumulationConfig, ctx: ShardCtx, params: Any
) -> accum.ReductionPlan:
    """The step's reduction plan (accum.make_plan), read by everything that reduces,
    tags or reports gradients; its accumulation schedule checked against it
    (accum.check_schedule).

    `params`: arrays or ShapeDtypeStructs in the layout the model computes with
    (before ZeRO-1 shards them). The batch axes are the token axes; the slice
    axes the dcn_ ones, and 'expert' when it crosses slices (`slices.slice_axes`).
    Per parameter: the model gathers weights sharded over a
    batch axis with a tagged reshard (`ShardCtx.weight`) and the experts enter
    the MoE shard_map, so such a weight reduces that axis per use and defers the others.

    accum owns the rules of both (a policy that cannot apply to this mesh, a schedule
    that means nothing under the plan): its refusal comes out as a ConfigError
    naming gradient_reduction_policy= or gradient_accumulation_schedule= and the keys
    that fed it, with accum's reason word for word.
    """
    shape = dict(ctx.mesh.shape)
    policy, mode = accumulation.gradient_reduction_policy, parallelism.shard_mode
    try:
        plan = accum.make_plan(
            params,
            batch_axes=ctx.token_axes,
            mesh_shape=shape,
            policy=policy,
            mode=mode,
            slice_axes=slice_axes(shape, dict(ctx.dcn_parts)),
            per_parameter=True,
        )
    except accum.PlanError as error:
        dcn = ", ".join(f"{a}_parallelism={shape.get(a, 1)}" for a in DCN_AXES)
        if dict(ctx.dcn_parts).get("expert", 1) > 1:
            dcn += f", dcn_expert_parallelism={dict(ctx.dcn_parts)['expert']}"
        raise ConfigError(
            f"gradient_reduction_policy={policy} with shard_mode={mode}, {dcn} (the "
            f"cross-slice axes: num_slices, or compile_topology_num_slices, > 1): {error}"
        ) from error
    schedule = accumulation.gradient_accumulation_schedule
    try:
        accum.check_schedule(schedule, plan)
    except ValueError as error:
        raise ConfigError(
            f"gradient_accumulation_schedule={schedule} with shard_mode={mode}, "
            f"gradient_reduction_policy={policy}: {error}"
        ) from error
    return plan
