"""LoRA: trained low-rank adapters beside frozen projections (docs/finetune.md#lora).

A target weight W, dims (lead..., in..., out...) (lead: the routed experts' E dim;
a stacked layer adds its 'layers' axis in front of everything), gets two factors

    A (lead..., in..., r)   normal, scaled by 1/sqrt(prod(in))    <name>_lora_a
    B (lead..., r, out...)  zeros                                 <name>_lora_b

and the projection computes x W + (alpha / r) (x A) B: low-rank products, W itself
never updated. B = 0 makes step 0 the base model exactly. The factors are
`LoraParam` variables, which `trainer.model.define` splits from the parameters: the
train step differentiates them alone (the base enters as a constant), so the base has
no gradient, no optimizer state and no gradient reduction.

Sharding: A keeps W's logical axes on its lead and in dims, B on its lead and out
dims; the rank dim is replicated (logical None). The factors are used like any
weight (`ShardCtx.weight`), so the reduced tags of gradient accumulation ride on them
as on every trained parameter.

Target names (`lora_targets`, a comma list of names and groups):
    attention       wq (q_lora_rank=0) or wq_a, wq_b; wkv_a, wkv_b, wo  (the default)
    mlp             mlp_wi_0, mlp_wi_1, mlp_wo     the dense layers' MLP
    experts         expert_wi_0, expert_wi_1, expert_wo   routed experts
    shared_experts  shared_wi_0, shared_wi_1, shared_wo   shared experts
and transformers' module names (q_a_proj, kv_b_proj, gate_proj, ..., all-linear:
config/lora_targets.py). The factors' scale is PEFT's lora_alpha / r.
Every block that has the projection gets an adapter (the MTP blocks' too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config import ModelConfig
from trainer.config.lora_targets import resolve_targets
from trainer.model.params import LOGICAL, param
from trainer.sharding import ShardCtx

A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"


class LoraParam(nnx.Variable):
    """A LoRA factor (A or B): the only variables a run with lora_rank > 0 trains."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapters a model gets: their rank, the scale alpha / rank, the target names."""

    rank: int
    scale: float
    targets: frozenset[str]


def spec_of(model: ModelConfig) -> LoraSpec | None:
    """The model's LoRA spec, or None when lora_rank is 0."""
    if not model.lora_rank:
        return None
    return LoraSpec(model.lora_rank, model.lora_alpha / model.lora_rank, resolve_targets(model))


def attach(
    module: nnx.Module,
    attr: str,
    target: str,
    spec: LoraSpec | None,
    rngs: nnx.Rngs,
    *,
    logical: Sequence[str | None],
    lead: int = 0,
    ins: int = 1,
) -> None:
    """Give `module.attr` (a weight of logical axes `logical`: `lead` leading dims shared
    by both factors, then `ins` input dims, then output dims) its two factors when
    `spec` selects `target`; otherwise do nothing."""
    if spec is None or target not in spec.targets:
        return
    shape = tuple(getattr(module, attr)[...].shape)
    logical = tuple(logical)
    r, split = spec.rank, lead + ins
    # TAG: the rank dim is replicated (None); the other dims keep W's logical axes, so
    # A is laid out like W's input side and B like its output side.
    a_axes = (*logical[:split], None)
    b_axes = (*logical[:lead], None, *logical[split:])
    fan_in = math.prod(shape[lead:split])
    a = param(rngs, (*shape[:split], r), a_axes, fan_in=fan_in, kind=LoraParam)
    b = param(rngs, (*shape[:lead], r, *shape[split:]), b_axes, init="zeros", kind=LoraParam)
    setattr(module, attr + A_SUFFIX, a)
    setattr(module, attr + B_SUFFIX, b)
    module.lora_scale = spec.scale


def _factor_equations(equation: str, out: Sequence[str | None]) -> tuple[str, str, tuple]:
    """('x,A->h', 'h,B->y', h's logical axes) for the base product 'x,W->y', W's
    letters being its input (contracted) letters then its output letters."""
    inputs, _, y = equation.replace(" ", "").partition("->")
    x, w = inputs.split(",")
    w_in = "".join(c for c in w if c in x and c not in y)
    w_out = "".join(c for c in w if c in y)
    if w_in + w_out != w:
        raise ValueError(f"{equation!r}: the weight's letters must be inputs then outputs")
    r = next(c for c in "rzyxwvutsqponmlkjihgfedcba" if c not in equation)
    kept = "".join(c for c in x if c in y)
    h = kept + r
    h_axes = (*(out[y.index(c)] for c in kept), None)
    return f"{x},{w_in}{r}->{h}", f"{h},{r}{w_out}->{y}", h_axes


def project(
    ctx: ShardCtx,
    equation: str,
    x: jax.Array,
    module: nnx.Module,
    attr: str,
    logical: Sequence[str | None],
    *,
    out: Sequence[str | None],
    dtype,
) -> jax.Array:
    """`einsum(equation, x, module.attr)` landing on `out`, plus the adapters' low-rank
    term (alpha / r) (x A) B when the weight has them. Each weight is cast to `dtype`
    before `ctx.weight` (an FSDP gather then moves compute-dtype bytes)."""
    w = getattr(module, attr)[...].astype(dtype)
    y = ctx.einsum(equation, x, ctx.weight(w, logical), out=out)
    if not hasattr(module, attr + A_SUFFIX):
        return y
    a_var, b_var = getattr(module, attr + A_SUFFIX), getattr(module, attr + B_SUFFIX)
    a_logical, b_logical = (v.get_metadata()[LOGICAL] for v in (a_var, b_var))
    eq_a, eq_b, h_axes = _factor_equations(equation, out)
    h = ctx.einsum(eq_a, x, ctx.weight(a_var[...].astype(dtype), a_logical), out=h_axes)
    # The scale on the rank-sized activation: the cheapest place, and no tagged value meets it.
    h = h * jnp.asarray(module.lora_scale, h.dtype)
    return y + ctx.einsum(eq_b, h, ctx.weight(b_var[...].astype(dtype), b_logical), out=out)


def merge_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W + scale x A @ B in W's dtype (the product in f32); leading dims shared by A,
    B and W (stacked layers, experts) are batched."""
    lead = a.ndim + b.ndim - 2 - w.ndim
    r = a.shape[-1]
    ins = math.prod(a.shape[lead:-1])
    a3 = a.astype(jnp.float32).reshape(*a.shape[:lead], ins, r)
    b3 = b.astype(jnp.float32).reshape(*b.shape[:lead], r, -1)
    delta = jnp.matmul(a3, b3).reshape(w.shape)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def merged_params(params: dict, adapters: dict, scale: float) -> dict:
    """The base parameter tree with every adapted weight replaced by W + scale A @ B
    (what `export-hf` writes)."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = merged_params(value, adapters.get(key, {}), scale)
        elif key + A_SUFFIX in adapters:
            a, b = adapters[key + A_SUFFIX], adapters[key + B_SUFFIX]
            out[key] = merge_weight(value, a, b, scale)
        else:
            out[key] = value
    return out
