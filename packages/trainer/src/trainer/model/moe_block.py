"""The trainer's MoE feed-forward: moe_kernels' NNX `MoE` with the trainer's metadata."""

from __future__ import annotations

from jax.sharding import Mesh

import moe_kernels
from trainer.config import ModelConfig
from trainer.config.moe_map import moe_config
from trainer.model import lora
from trainer.model.params import CAST_AT_USE, INIT, LOGICAL, USE_DTYPE
from trainer.sharding import ShardCtx

# One NNX module and one bias variable type, moe_kernels'; the old names stay importable.
MoE = moe_kernels.MoE
RouterBias = moe_kernels.RoutingBias


def _metadata(name: str, shape: tuple, logical: tuple) -> dict:
    """What `trainer.model.params.param` attaches: the trainer draws the values
    on the host from this recipe (`host_value`), not from the module's init."""
    if name == "bias":
        return {LOGICAL: logical}  # zeros, kept in f32
    metadata = {LOGICAL: logical, INIT: ("normal", shape[-2] ** -0.5), CAST_AT_USE: True}
    if name == "gate":
        # moe_kernels' router computes its logits in f32 (layer.py, `_layer_body`).
        metadata[USE_DTYPE] = "float32"
    return metadata


def _manual_experts(ctx: ShardCtx) -> moe_kernels.ManualExperts | None:
    """Per device (ctx.manual) on a mesh whose 'expert' axis shards the experts: this
    device holds its E/size of them; the all-to-all dispatch where that axis also
    splits the tokens (expert_shard_attention_option=fsdp: a batch axis)."""
    size = dict(ctx.mesh.shape).get("expert", 1)
    if not ctx.manual or size == 1:
        return None
    return moe_kernels.ManualExperts(size, tokens_split="expert" in ctx.token_axes)


def moe_layer(config: ModelConfig, ctx: ShardCtx, *, rngs) -> moe_kernels.MoE:
    """Routed experts (sparse ragged_dot or dense reference) plus shared experts, with
    LoRA adapters on the expert kernels lora_targets names (moe_kernels merges them
    into the kernels inside its shard_map)."""
    layer = moe_kernels.MoE(
        moe_config(config),
        config.emb_dim,
        rngs=rngs,
        sparse=config.sparse_matmul,
        # Inside the caller's shard_map (ctx.manual) the tokens are already per
        # device: moe_kernels' own shard_map cannot nest there. What is left to
        # shard there is the experts (a pipeline stage's, over the 'expert' axis).
        mesh=None if ctx.manual else ctx.mesh,
        rules=None if ctx.manual else ctx.rules,
        mode=None if ctx.manual else ctx.mode,
        manual=_manual_experts(ctx),
        # The program's target (an AOT topology's, from a CPU host too) picks the
        # grouped matmul, not this process' backend. An abstract mesh (a plan read
        # without devices) has none: moe_kernels then takes this process' first.
        device=ctx.mesh.devices.flat[0] if isinstance(ctx.mesh, Mesh) else None,
        dtype=config.dtype,
        metadata=_metadata,
        place=False,  # the trainer places every parameter itself, after init
        # A rematerialized layer saves no residuals of its own: the MoE
        # checkpoint would only add memory there (0.36 GiB on 671b / v5p).
        # selective saves what `none` saves but the named norm/SwiGLU outputs, so
        # the casts' recompute still pays there.
        recompute_casts=ctx.manual or config.remat_policy in ("none", "selective"),
    )
    spec, axes = lora.spec_of(config), layer.config.logical_axes
    for name in moe_kernels.LORA_TARGETS:
        # Routed kernels (E, in, out) share their expert dim with both factors.
        lead, target = (0, name) if name.startswith("shared_") else (1, "expert_" + name)
        if hasattr(layer, name):
            lora.attach(layer, name, target, spec, rngs, logical=axes[name], lead=lead)
    return layer
