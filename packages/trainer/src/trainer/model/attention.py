"""Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv with decoupled RoPE."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config import ModelConfig
from trainer.model.layers import BSE, RMSNorm
from trainer.model.params import param
from trainer.model.rope import rope, softmax_scale
from trainer.sharding import ShardCtx


@dataclasses.dataclass(frozen=True)
class MLANames:
    """Every logical axis name this layer uses, weights and activations, in one place."""

    # Weights.
    wq: tuple = ("embed", "heads", "head_dim")  # q_lora_rank=0: the plain projection
    wq_a: tuple = ("embed", "q_lora")
    wq_b: tuple = ("q_lora", "heads", "head_dim")
    wkv_a: tuple = ("embed", "kv_lora")
    wkv_b: tuple = ("kv_lora", "heads", "head_dim")
    wo: tuple = ("heads", "head_dim", "embed")
    # Activations.
    q: tuple = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
    kv: tuple = (
        "activation_batch",
        "activation_kv_length",
        "activation_heads",
        "activation_head_dim",
    )
    lora: tuple = ("activation_batch", "activation_length", "activation_lora")
    scores: tuple = (
        "activation_batch",
        "activation_heads",
        "activation_length",
        "activation_kv_length",
    )
    out: tuple = BSE


NAMES = MLANames()


class MLA(nnx.Module):
    """Queries through a q_lora bottleneck (or, with q_lora_rank=0, one plain
    projection `wq_DxHxK`); keys/values from one shared kv_lora latent.

    Shapes: D embed, H heads, Q q_lora_rank, C kv_lora_rank, N nope dim,
    R rope dim, V value dim, K = N + R.
    """

    def __init__(self, config: ModelConfig, ctx: ShardCtx, *, rngs: nnx.Rngs):
        c = config
        d, h = c.emb_dim, c.base_num_query_heads
        if c.q_lora_rank:
            self.wq_a_DxQ = param(rngs, (d, c.q_lora_rank), NAMES.wq_a)
            self.q_norm = RMSNorm(c.q_lora_rank, c.normalization_layer_epsilon, rngs=rngs)
            self.wq_b_QxHxK = param(rngs, (c.q_lora_rank, h, c.qk_head_dim), NAMES.wq_b)
        else:
            self.wq_DxHxK = param(rngs, (d, h, c.qk_head_dim), NAMES.wq)
        self.wkv_a_DxCR = param(rngs, (d, c.kv_lora_rank + c.qk_rope_head_dim), NAMES.wkv_a)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.normalization_layer_epsilon, rngs=rngs)
        self.wkv_b_CxHxNV = param(
            rngs,
            (c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim),
            NAMES.wkv_b,
        )
        self.wo_HxVxD = param(rngs, (h, c.v_head_dim, d), NAMES.wo, fan_in=h * c.v_head_dim)
        self.config, self.ctx = config, ctx
        self.dtype = jnp.dtype(config.dtype)

    def _queries(self, x_BxSxD: jax.Array) -> jax.Array:
        """q_BxSxHxK before RoPE: through the low-rank path, or the plain one."""
        ctx, dt = self.ctx, self.dtype
        if not self.config.q_lora_rank:
            return ctx.einsum(
                "bsd,dhk->bshk",
                x_BxSxD,
                ctx.weight(self.wq_DxHxK[...].astype(dt), NAMES.wq),
                out=NAMES.q,
            )
        q_BxSxQ = ctx.einsum(
            "bsd,dq->bsq",
            x_BxSxD,
            ctx.weight(self.wq_a_DxQ[...].astype(dt), NAMES.wq_a),
            out=NAMES.lora,
        )
        return ctx.einsum(
            "bsq,qhk->bshk",
            self.q_norm(q_BxSxQ),
            ctx.weight(self.wq_b_QxHxK[...].astype(dt), NAMES.wq_b),
            out=NAMES.q,
        )

    def __call__(
        self, x_BxSxD: jax.Array, positions_BxS: jax.Array, segments_BxS: jax.Array
    ) -> jax.Array:
        c, ctx, dt = self.config, self.ctx, self.dtype
        nope, rope_dim = c.qk_nope_head_dim, c.qk_rope_head_dim

        q_BxSxHxK = self._queries(x_BxSxD)
        q_nope, q_pe = q_BxSxHxK[..., :nope], q_BxSxHxK[..., nope:]
        q_BxSxHxK = jnp.concatenate([q_nope, rope(q_pe, positions_BxS, c)], -1)

        kv_BxSxCR = ctx.einsum(
            "bsd,dc->bsc",
            x_BxSxD,
            ctx.weight(self.wkv_a_DxCR[...].astype(dt), NAMES.wkv_a),
            out=NAMES.lora,
        )
        kv_c, k_pe_BxSxR = kv_BxSxCR[..., : c.kv_lora_rank], kv_BxSxCR[..., c.kv_lora_rank :]
        kv_BxSxHxNO = ctx.einsum(
            "bsc,chk->bshk",
            self.kv_norm(kv_c),
            ctx.weight(self.wkv_b_CxHxNV[...].astype(dt), NAMES.wkv_b),
            out=NAMES.q,
        )
        k_nope, v_BxSxHxO = kv_BxSxHxNO[..., :nope], kv_BxSxHxNO[..., nope:]
        # One rope key shared by every head (DeepSeek's decoupled RoPE).
        k_pe_BxSx1xR = rope(k_pe_BxSxR[:, :, None, :], positions_BxS, c)
        # Laid out like k_nope (heads over 'tensor') so the concatenate type-checks.
        k_pe_BxSxHxR = ctx.act(
            jnp.broadcast_to(k_pe_BxSx1xR, (*k_nope.shape[:3], rope_dim)), NAMES.q
        )
        k_BxSxHxK = jnp.concatenate([k_nope, k_pe_BxSxHxR], -1)

        # Context parallelism: queries keep their sequence shard, keys and values
        # are gathered over it (activation_kv_length maps to no mesh axis).
        k_BxUxHxK = ctx.act(k_BxSxHxK, NAMES.kv)
        v_BxUxHxO = ctx.act(v_BxSxHxO, NAMES.kv)
        kv_positions_BxU = ctx.act(positions_BxS, NAMES.kv[:2])
        kv_segments_BxU = ctx.act(segments_BxS, NAMES.kv[:2])

        # qk_head_dim^-0.5, with YaRN's mscale correction when rope_type=yarn.
        scale = softmax_scale(c)
        logits_BxHxSxU = ctx.einsum(
            "bshk,bthk->bhst", q_BxSxHxK * scale, k_BxUxHxK, out=NAMES.scores
        ).astype(jnp.float32)
        causal = positions_BxS[:, None, :, None] >= kv_positions_BxU[:, None, None, :]
        same_doc = segments_BxS[:, None, :, None] == kv_segments_BxU[:, None, None, :]
        logits_BxHxSxU = jnp.where(causal & same_doc, logits_BxHxSxU, -1e30)
        probs_BxHxSxU = jax.nn.softmax(logits_BxHxSxU, axis=-1).astype(dt)
        out_BxSxHxO = ctx.einsum("bhst,bthv->bshv", probs_BxHxSxU, v_BxUxHxO, out=NAMES.q)
        return ctx.einsum(
            "bshv,hvd->bsd",
            out_BxSxHxO,
            ctx.weight(self.wo_HxVxD[...].astype(dt), NAMES.wo),
            out=NAMES.out,
        )
