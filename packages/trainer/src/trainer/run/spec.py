"""Decide, then build: `resolve(config, devices)` makes every decision a run needs.

A `RunSpec` is frozen: the validated config (with a concrete
gradient_reduction_policy), the devices in mesh order, the mesh shape, the global
batch, the mesh context, the model's structure, the trained parameters as
ShapeDtypeStructs (compute layout: what the step differentiates and reduces), the
auto decision (`choice`, None for an explicit policy) and the one ReductionPlan.
`run.build(spec)` then makes state and step from it and decides nothing, so a
concrete run, an AOT compile and each policy auto falls back to build the same
thing from the same decisions (`spec.with_policy(p)`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType

import accum
from trainer import model as model_lib
from trainer.config import MESH_AXES, Config, dcn_parts
from trainer.config.layer_loop import decide_scan_layers
from trainer.config.pipeline import pipeline_microbatches
from trainer.config.validate import global_batch_size, validate
from trainer.model import attention_kernel
from trainer.sharding import ShardCtx, logical_rules, make_mesh, reduction_plan, slices
from trainer.step import reduction_choice


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Every decision of a run, before anything is allocated or compiled."""

    config: Config  # validated; gradient_reduction_policy and scan_layers never "auto" here
    devices: tuple  # in mesh order (slice-major on several slices); () on an AbstractMesh
    mesh_shape: dict[str, int]
    batch_size: int  # sequences per optimizer step, all microbatches
    ctx: ShardCtx
    model: model_lib.ModelDef
    trained: Any  # ShapeDtypeStructs of the trained parameters (LoRA: the adapters)
    plan: accum.ReductionPlan
    choice: reduction_choice.Choice | None = None  # the auto decision, when it was asked

    def with_policy(self, policy: str, choice: reduction_choice.Choice | None = None) -> RunSpec:
        """This spec under another gradient_reduction_policy: the config and the plan
        change, nothing else (auto's fallback when a policy does not fit in HBM)."""
        config = dataclasses.replace(self.config, gradient_reduction_policy=policy)
        plan = reduction_plan(config.parallelism, config.accumulation, self.ctx, self.trained)
        return dataclasses.replace(self, config=config, plan=plan, choice=choice)


def trained_shapes(model: model_lib.ModelDef, ctx: ShardCtx) -> Any:
    """ShapeDtypeStructs (with shardings) of what the step trains: the parameters, or
    under LoRA the adapter factors (the parameters are then the frozen base)."""
    if model.lora:
        return model_lib.abstract_adapters(model, ctx)
    params, _ = model_lib.abstract_state(model, ctx)
    return params


def resolve(config: Config, devices: list | tuple) -> RunSpec:
    """Validate `config` for `devices` (ConfigError before anything is built), lay out
    the mesh, define the model, decide gradient_reduction_policy=auto (the one place
    it is decided) and make the reduction plan. Allocates nothing."""
    devices = list(devices)
    num_slices = slices.num_slices(config.parallelism, devices)
    devices = slices.slice_major(devices) if num_slices > 1 else devices
    sizes = validate(config, len(devices), num_slices)
    dcn = dcn_parts(config.parallelism, len(devices), num_slices)
    mesh = make_mesh(sizes, config.shard_mode, devices, dcn)
    return _decide(config, tuple(devices), sizes, mesh, dcn)


def resolve_abstract(config: Config, num_devices: int = 8, num_slices: int = 1) -> RunSpec:
    """`resolve` on an AbstractMesh of `num_devices` (in `num_slices` slices): no device
    is needed or touched (plan-reduction on a TPU topology, counting parameters). Its
    `devices` are empty: such a spec plans and counts, it is not built."""
    sizes = validate(config, num_devices, num_slices)
    kind = AxisType.Explicit if config.shard_mode == "explicit" else AxisType.Auto
    shape = tuple(sizes.get(axis, 1) for axis in MESH_AXES)
    mesh = AbstractMesh(shape, MESH_AXES, axis_types=(kind,) * len(MESH_AXES))
    dcn = dcn_parts(config.parallelism, num_devices, num_slices)
    with jax.sharding.use_abstract_mesh(mesh):  # the model's specs resolve on it
        return _decide(config, (), sizes, mesh, dcn)


def _decide(
    config: Config, devices: tuple, sizes: dict[str, int], mesh: Any, dcn: dict[str, int]
) -> RunSpec:
    """Everything after the mesh: batch, ctx, model, trained shapes, auto, plan
    (`dcn`: the cross-slice parts of the 'stage' and 'expert' axes)."""
    # scan_layers=auto decided for these devices first: the model's definition and
    # auto's policy ranking (which gradients a layer loop sums) both read it.
    config = decide_scan_layers(config, devices)
    batch = global_batch_size(config.accumulation, config.data, math.prod(sizes.values()))
    ctx = ShardCtx(
        mesh,
        logical_rules(config.parallelism),
        config.shard_mode,
        pipeline_microbatches=pipeline_microbatches(config.parallelism, config.accumulation),
        pipeline_repeats=config.num_pipeline_repeats,
        dcn_parts=tuple(dcn.items()),
    )
    # A fused attention kernel asked for by name that cannot run on this mesh at this
    # sequence length (or in the pipeline's stages, which run per-device code) is
    # refused here, before the model is built or traced.
    staged = sizes.get("stage", 1) > 1
    for where in (ctx, dataclasses.replace(ctx, mode="manual")) if staged else (ctx,):
        attention_kernel.choose_kernel(config.model, where, config.data.max_target_length)
    model = model_lib.define(config.model, ctx)
    trained = trained_shapes(model, ctx)
    choice = None
    if config.gradient_reduction_policy == "auto":
        choice = reduction_choice.choose(config, ctx, model, trained, devices)
    spec = RunSpec(config, devices, sizes, batch, ctx, model, trained, None)
    return spec.with_policy(choice.policy if choice else config.gradient_reduction_policy, choice)


def check_built(spec: RunSpec, trained: Any) -> None:
    """RuntimeError when built parameters differ from the spec's in shape, dtype or
    sharding: the plan and the auto decision were made for the spec's."""
    want = jax.tree.map(lambda s: (s.shape, s.dtype, s.sharding), spec.trained)
    have = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), trained)
    if jax.tree.structure(want) != jax.tree.structure(have):
        raise RuntimeError("built parameters have another tree structure than the spec's")
    for (path, w), h in zip(
        jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.leaves(have, is_leaf=lambda x: isinstance(x, tuple)),
        strict=True,
    ):
        if w[:2] != h[:2] or not w[2].is_equivalent_to(h[2], len(w[0])):
            raise RuntimeError(
                f"built parameter {jax.tree_util.keystr(path)} is {h[1]}{list(h[0])} on "
                f"{h[2].spec}, the spec's {w[1]}{list(w[0])} on {w[2].spec}"
            )
