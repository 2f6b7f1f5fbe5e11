"""Model construction and the functional view the train step works with.

Outside the model, parameters are plain nested dicts of arrays (what accum,
optax and orbax want); `apply` merges them back into the NNX module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from moe_kernels import RoutingBias
from trainer.config import ModelConfig
from trainer.model.decoder import Decoder, unstack_layers
from trainer.model.lora import LoraParam, merged_params
from trainer.model.params import (
    cast_at_use_of,
    host_value,
    logical_axes_of,
    summed_in_use_of,
    use_dtype_of,
)
from trainer.model.pipeline import stages
from trainer.model.pipeline_slots import Slots, pad_rows, stack_slots
from trainer.sharding import ShardCtx

# Top-level parameter groups stacked on a leading 'layers' axis (the MTP depths too).
STACKS = ("dense_layers", "moe_layers", "mtp")
# The stack whose layer axis is the pipeline's ('stage_layers': split over 'stage').
PIPELINED = "moe_layers"


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of the model: graph and state templates, plus shardings."""

    graphdef: Any
    param_template: Any
    router_template: Any
    param_logical: dict
    router_logical: dict
    weight_dtype: str = "float32"  # parameters' storage dtype (router biases stay f32)
    param_cast_at_use: dict | None = None  # params.CAST_AT_USE per parameter
    param_use_dtype: dict | None = None  # params.USE_DTYPE per parameter (None: unset)
    param_summed_in_use: dict | None = None  # params.SUMMED_IN_USE per parameter
    # LoRA (lora_rank > 0): the adapter factors' template and logical axes (empty
    # without LoRA), and their scale alpha / rank.
    adapter_template: Any = None
    adapter_logical: dict = dataclasses.field(default_factory=dict)
    lora_scale: float = 1.0
    # Uneven pipeline stages: the padded MoE stack's layout (model/pipeline_slots.py;
    # None: not padded).
    moe_layout: Slots | None = None

    @property
    def lora(self) -> bool:
        """Whether the model has LoRA adapters (then they alone are trained)."""
        return bool(self.adapter_logical)


def _logical_tree(state: nnx.State, read=logical_axes_of) -> dict:
    """`read(variable, stacked)` of every variable, as a nested dict: by default its
    logical axes (stacked layers get a leading 'layers' axis; the MoE layers'
    'stage_layers', which the pipeline's stages split: model/pipeline.py)."""
    out: dict = {}
    for path, variable in nnx.to_flat_state(state):
        stacked = path[0] in STACKS
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        value = read(variable, stacked)
        if read is logical_axes_of and path[0] == PIPELINED:
            # Size one without stages: the same layout as 'layers' then.
            value = ("stage_layers", *value[1:])
        node[path[-1]] = value
    return out


def define(config: ModelConfig, ctx: ShardCtx) -> ModelDef:
    """Trace the model's structure (the model group's keys) without allocating
    parameters."""
    # Shapes only: no value is drawn here (init draws them from the seed), so
    # any key serves the trace.
    abstract = nnx.eval_shape(lambda: Decoder(config, ctx, rngs=nnx.Rngs(0)))
    # LoRA factors first: the parameters are everything else, the frozen base.
    graphdef, adapters, params, router = nnx.split(abstract, LoraParam, nnx.Param, RoutingBias)
    return ModelDef(
        graphdef,
        params,
        router,
        _logical_tree(params),
        _logical_tree(router),
        weight_dtype=config.weight_dtype,
        param_cast_at_use=_logical_tree(params, cast_at_use_of),
        param_use_dtype=_logical_tree(params, use_dtype_of),
        param_summed_in_use=_logical_tree(params, summed_in_use_of),
        adapter_template=adapters,
        adapter_logical=_logical_tree(adapters),
        lora_scale=config.lora_alpha / config.lora_rank if config.lora_rank else 1.0,
        moe_layout=stack_slots(config, stages(ctx), ctx.pipeline_repeats),
    )


def trained_view(model: ModelDef) -> ModelDef:
    """`model` with its param_* fields describing what the optimizer trains: the
    parameters, or with LoRA the adapter factors (f32, cast to the compute dtype at
    their one use, like a matmul weight)."""
    if not model.lora:
        return model
    leaf = lambda value: jax.tree.map(lambda _: value, model.adapter_logical, is_leaf=_is_axes)  # noqa: E731
    return dataclasses.replace(
        model,
        param_template=model.adapter_template,
        param_logical=model.adapter_logical,
        weight_dtype="float32",
        param_cast_at_use=leaf(True),
        param_use_dtype=leaf(None),
        param_summed_in_use=leaf(False),
    )


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def shardings(tree_logical: dict, shapes: Any, ctx: ShardCtx) -> Any:
    """NamedShardings for a tree of logical axes, fitted to the leaves' shapes."""
    return jax.tree.map(
        lambda axes, leaf: ctx.sharding(axes, leaf.shape), tree_logical, shapes, is_leaf=_is_axes
    )


def abstract_state(model: ModelDef, ctx: ShardCtx) -> tuple[dict, dict]:
    """ShapeDtypeStructs (with shardings) of the params and the router biases."""

    def structs(template, logical, dtype=None):
        shapes = nnx.to_pure_dict(template)
        specs = shardings(logical, shapes, ctx)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype, sharding=sh),
            shapes,
            specs,
        )

    return structs(model.param_template, model.param_logical, model.weight_dtype), structs(
        model.router_template, model.router_logical
    )


def abstract_adapters(model: ModelDef, ctx: ShardCtx) -> dict:
    """ShapeDtypeStructs (f32, with shardings) of the LoRA factors ({} without LoRA)."""
    if not model.lora:
        return {}
    shapes = nnx.to_pure_dict(model.adapter_template)
    specs = shardings(model.adapter_logical, shapes, ctx)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, "float32", sharding=sh), shapes, specs
    )


def init_adapters(ctx: ShardCtx, model: ModelDef, seed: int) -> dict:
    """The LoRA factors drawn on the host from `seed` (A normal, B zeros), placed."""
    if not model.lora:
        return {}
    return _host_init(model.adapter_template, abstract_adapters(model, ctx), seed)


def merged(model: ModelDef, params: dict, adapters: dict) -> dict:
    """The parameters with the adapters merged in (W + alpha / r x A @ B per adapted
    weight, in W's dtype): one model with the LoRA run's function, for export."""
    return merged_params(params, adapters, model.lora_scale) if model.lora else params


def _host_init(template: nnx.State, abstract: dict, seed: int, layout: Slots | None = None) -> dict:
    out: dict = {}
    for path, variable in nnx.to_flat_state(template):
        node_abs, node = abstract, out
        for key in path[:-1]:
            node_abs, node = node_abs[key], node.setdefault(key, {})
        target = node_abs[path[-1]]
        if layout is not None and path[0] == PIPELINED:
            # The real layers drawn as without stages (L rows), zeros in the padding.
            value = pad_rows(host_value(variable, path, seed, layout.layers), layout)
        else:
            value = host_value(variable, path, seed)
        value = value.astype(target.dtype)
        node[path[-1]] = jax.make_array_from_callback(
            value.shape, target.sharding, lambda index, value=value: value[index]
        )
    return out


def init(ctx: ShardCtx, model: ModelDef, seed: int) -> tuple[dict, dict]:
    """Parameters and router biases, drawn on the host from `seed` and placed in
    their shardings."""
    params_abs, router_abs = abstract_state(model, ctx)
    return (
        _host_init(model.param_template, params_abs, seed, model.moe_layout),
        _host_init(model.router_template, router_abs, seed, model.moe_layout),
    )


def _fill(template: nnx.State, pure: dict) -> nnx.State:
    state = jax.tree.map(lambda x: x, template)  # a fresh copy: replace_by_pure_dict mutates
    nnx.replace_by_pure_dict(state, pure)
    return state


def unstacked(params: dict) -> dict:
    """`params` with each stacked group (STACKS) split into its layers
    (decoder.LayerViews): what the unrolled layer loop reads without slicing the
    stacks (the train step's `prepare`, run once per step before the microbatch loop)."""
    return unstack_layers(params, STACKS)


def build_decoder(
    model: ModelDef, params: dict, router: dict, adapters: dict | None = None
) -> Decoder:
    """The NNX Decoder holding plain-dict `params`, `router` (and a LoRA model's
    `adapters`), so it can be called whole or its parts run one by one."""
    states = [_fill(model.param_template, params), _fill(model.router_template, router)]
    if model.lora:
        if adapters is None:
            raise ValueError("this model has LoRA adapters (lora_rank > 0): pass adapters=")
        states.append(_fill(model.adapter_template, adapters))
    return nnx.merge(model.graphdef, *states)


def apply(
    model: ModelDef,
    params: dict,
    router: dict,
    tokens_BxS,
    positions_BxS,
    segments_BxS,
    adapters: dict | None = None,
):
    """Run the decoder on plain-dict parameters: (logits_BxSxV f32, MoE stats).
    `adapters`: the LoRA factors, required when the model has them."""
    return build_decoder(model, params, router, adapters)(tokens_BxS, positions_BxS, segments_BxS)


def apply_pipelined(
    model: ModelDef, params: dict, router: dict, batch: dict, token_nll, mtp_scale_D=None
):
    """`Decoder.pipelined_sums` on plain-dict parameters (pipeline stages, training):
    (per-token-shard loss sums, MoE stats, MTP MoE stats), every part of the model
    one pipeline microbatch at a time."""
    return build_decoder(model, params, router).pipelined_sums(batch, token_nll, mtp_scale_D)


def apply_with_mtp(
    model: ModelDef,
    params: dict,
    router: dict,
    batch: dict,
    consume,
    depths: int | None = None,
    adapters: dict | None = None,
):
    """`Decoder.with_mtp` on plain-dict parameters: ((logits, MoE stats), [consume(
    logits, targets, weights) per MTP depth], MTP MoE stats). `batch` holds inputs,
    targets, positions, segments and weights (a microbatch); `adapters` as in `apply`."""
    return build_decoder(model, params, router, adapters).with_mtp(batch, consume, depths)
