"""The sharding plan of one MoE layer's shard_map: the activations' spec, the
parameters' in_specs (each carrying its value's `reduced` tag in explicit mode),
and whether experts are sharded and how tokens reach them (all-to-all or local)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_kernels import lora
from moe_kernels.config import MoEConfig
from moe_kernels.params import EXPERT_PARAMS, Params, param_specs
from pspec_tags import (
    carry_reduced_axes,
    entry_axes,
    entry_from_axes,
    fit_to_shape,
    logical_to_spec,
    mesh_axes_used,
    partitions,
)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Everything static the shard_map body needs."""

    token_spec: P  # (B, S, D) in_spec/out_spec of the activations
    token_axes: tuple[str, ...]  # mesh axes that shard tokens
    specs: dict[str, P]  # in_specs of the parameters (tagged in explicit mode)
    ep: int  # expert-parallel degree (1 = every shard holds all experts)
    a2a: bool  # tokens sharded over the expert axis: all-to-all dispatch
    expert_axis: str


@dataclasses.dataclass(frozen=True)
class ManualExperts:
    """Expert parallelism for a caller already inside a fully manual `jax.shard_map`
    (a pipeline stage's per-device layers): `config.expert_axis` is one of that map's
    manual axes, of `size`, and each device holds experts [i x E/size, (i+1) x E/size)
    on the routed kernels' dim 0 (their LoRA factors' too). `tokens_split`: the expert
    axis also shards the tokens (as a batch axis): the routed rows travel to their
    experts' device by all-to-all; else the tokens are the same on every expert shard,
    each runs its own experts and the outputs are summed over the axis."""

    size: int
    tokens_split: bool = True


def manual_plan(config: MoEConfig, experts: ManualExperts) -> ShardPlan:
    """The plan of a body run in the caller's manual region: nothing to gather (every
    weight arrives whole but for its experts), the expert axis' size and dispatch."""
    if config.num_experts % experts.size:
        raise ValueError(
            f"num_experts={config.num_experts} is not divisible by the {experts.size} "
            f"shards of the manual expert axis {config.expert_axis!r}"
        )
    split = experts.tokens_split and experts.size > 1
    token_axes = (config.expert_axis,) if split else ()
    return ShardPlan(P(), token_axes, {}, experts.size, split, config.expert_axis)


def infer_mode(mesh: Any) -> str:
    types = set(getattr(mesh, "axis_types", ()) or ())
    return "explicit" if AxisType.Explicit in types else "auto"


def shard_plan(
    x: jax.Array,
    params: Params,
    config: MoEConfig,
    mesh: Any,
    rules: Any,
    mode: str,
    keep_tags: bool,
    sparse: bool,
) -> ShardPlan:
    sizes = dict(mesh.shape)
    token_spec = logical_to_spec((config.batch_axis, config.length_axis, None), rules, mesh)
    token_spec = fit_to_shape(token_spec, x.shape, mesh)
    token_axes = mesh_axes_used(token_spec)
    shapes = {name: tuple(w.shape) for name, w in params.items()}
    rebuilt = param_specs(config, rules, mesh, shapes)
    specs = {}
    ep = 1
    for name, spec in rebuilt.items():
        # A routed kernel's LoRA factors share its expert dim (and its expert sharding).
        expert = lora.base_name(name) in EXPERT_PARAMS
        entries = []
        for dim, entry in enumerate(partitions(spec)):
            # Inside the body a weight may stay sharded over axes that shard the
            # tokens (it is all-gathered there; the transpose of that gather is
            # the reduce-scatter FSDP wants) and, for the sparse path, over the
            # expert axis on its expert dim. Other axes are gathered before the
            # shard_map by the in_spec itself.
            keep = [
                a
                for a in entry_axes(entry)
                if a in token_axes or (sparse and expert and dim == 0 and a == config.expert_axis)
            ]
            entries.append(entry_from_axes(keep))
        spec = P(*entries)
        if sparse and expert and partitions(spec) and partitions(spec)[0]:
            ep = sizes[config.expert_axis]
        if mode == "explicit" and keep_tags:
            # TAG: the spec was rebuilt from logical rules and carries no tag. A
            # parameter that gradient accumulation made `reduced` over the batch
            # axes must enter the shard_map with that tag, else shard_map psums
            # its cotangent over those axes inside the body (per microbatch, per
            # layer). carry_reduced_axes copies the value's own reduced axes;
            # it declines on overlap with the partitions and outside explicit mode.
            spec = carry_reduced_axes(spec, params[name])
        specs[name] = spec
    a2a = ep > 1 and config.expert_axis in token_axes
    return ShardPlan(token_spec, token_axes, specs, ep, a2a, config.expert_axis)
