"""Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv with decoupled RoPE."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import pspec_tags as pt
from trainer.config import ModelConfig
from trainer.model import attention_kernel, cudnn_attention, lora, splash_attention
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
        # The latent norms' own epsilon when set (a Hugging Face import: 1e-6).
        latent_eps = c.latent_norm_epsilon
        latent_eps = latent_eps if latent_eps >= 0 else c.normalization_layer_epsilon
        if c.q_lora_rank:
            self.wq_a_DxQ = param(rngs, (d, c.q_lora_rank), NAMES.wq_a)
            self.q_norm = RMSNorm(c.q_lora_rank, latent_eps, rngs=rngs)
            self.wq_b_QxHxK = param(rngs, (c.q_lora_rank, h, c.qk_head_dim), NAMES.wq_b)
        else:
            self.wq_DxHxK = param(rngs, (d, h, c.qk_head_dim), NAMES.wq)
        self.wkv_a_DxCR = param(rngs, (d, c.kv_lora_rank + c.qk_rope_head_dim), NAMES.wkv_a)
        self.kv_norm = RMSNorm(c.kv_lora_rank, latent_eps, rngs=rngs)
        self.wkv_b_CxHxNV = param(
            rngs,
            (c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim),
            NAMES.wkv_b,
        )
        self.wo_HxVxD = param(rngs, (h, c.v_head_dim, d), NAMES.wo, fan_in=h * c.v_head_dim)
        self._attach_lora(lora.spec_of(config), rngs)
        self.config, self.ctx = config, ctx
        self.dtype = jnp.dtype(config.dtype)
        # "dot_product", "cudnn_flash" or "splash" as far as the mesh decides (a kernel
        # asked for by name that cannot run here is refused now, before any trace);
        # the sequence length is checked when the layer first sees one (__call__).
        self.kernel = attention_kernel.choose_kernel(config, ctx)
        # What the cuDNN call can use on these GPUs (None: not the cuDNN kernel).
        self.cudnn = (
            attention_kernel.cudnn_plan(config, ctx) if self.kernel == "cudnn_flash" else None
        )

    def _attach_lora(self, spec: lora.LoraSpec | None, rngs: nnx.Rngs) -> None:
        """LoRA adapters on the projections `spec` targets (none without LoRA)."""
        weights = (
            ("wq_DxHxK", "wq", NAMES.wq),
            ("wq_a_DxQ", "wq_a", NAMES.wq_a),
            ("wq_b_QxHxK", "wq_b", NAMES.wq_b),
            ("wkv_a_DxCR", "wkv_a", NAMES.wkv_a),
            ("wkv_b_CxHxNV", "wkv_b", NAMES.wkv_b),
            ("wo_HxVxD", "wo", NAMES.wo),
        )
        for attr, target, logical in weights:
            if hasattr(self, attr):
                ins = 2 if attr == "wo_HxVxD" else 1  # wo contracts heads and value dims
                lora.attach(self, attr, target, spec, rngs, logical=logical, ins=ins)

    def _project(self, equation, x, attr, logical, out):
        """One projection of this layer (with its LoRA adapters, when it has them)."""
        return lora.project(self.ctx, equation, x, self, attr, logical, out=out, dtype=self.dtype)

    def _queries(self, x_BxSxD: jax.Array) -> jax.Array:
        """q_BxSxHxK before RoPE: through the low-rank path, or the plain one."""
        if not self.config.q_lora_rank:
            return self._project("bsd,dhk->bshk", x_BxSxD, "wq_DxHxK", NAMES.wq, NAMES.q)
        q_BxSxQ = self._project("bsd,dq->bsq", x_BxSxD, "wq_a_DxQ", NAMES.wq_a, NAMES.lora)
        return self._project(
            "bsq,qhk->bshk", self.q_norm(q_BxSxQ), "wq_b_QxHxK", NAMES.wq_b, NAMES.q
        )

    def __call__(
        self, x_BxSxD: jax.Array, positions_BxS: jax.Array, segments_BxS: jax.Array
    ) -> jax.Array:
        c, ctx = self.config, self.ctx
        nope, rope_dim = c.qk_nope_head_dim, c.qk_rope_head_dim

        # RoPE on the last rope_dim dims of q in place: the nope dims pass through
        # the same fusion (no slice and concatenate around it).
        q_BxSxHxK = rope(self._queries(x_BxSxD), positions_BxS, c, start=nope)

        kv_BxSxCR = self._project("bsd,dc->bsc", x_BxSxD, "wkv_a_DxCR", NAMES.wkv_a, NAMES.lora)
        kv_c, k_pe_BxSxR = kv_BxSxCR[..., : c.kv_lora_rank], kv_BxSxCR[..., c.kv_lora_rank :]
        kv_BxSxHxNO = self._project(
            "bsc,chk->bshk", self.kv_norm(kv_c), "wkv_b_CxHxNV", NAMES.wkv_b, NAMES.q
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
        # Per device (the pipeline's manual ctx): all-gathered over 'context' here.
        k_BxUxHxK = ctx.relayout(k_BxSxHxK, NAMES.q, NAMES.kv)
        v_BxUxHxO = ctx.relayout(v_BxSxHxO, NAMES.q, NAMES.kv)
        kv_positions_BxU = ctx.relayout(positions_BxS, NAMES.q[:2], NAMES.kv[:2])
        kv_segments_BxU = ctx.relayout(segments_BxS, NAMES.q[:2], NAMES.kv[:2])

        # qk_head_dim^-0.5, with YaRN's mscale correction when rope_type=yarn.
        scale = softmax_scale(c)
        # The same policy again with the sequence length (splash needs 128-row tiles).
        kernel = attention_kernel.choose_kernel(c, ctx, q_BxSxHxK.shape[1])
        if kernel == "cudnn_flash":
            out_BxSxHxO = self._cudnn_flash(
                q_BxSxHxK, k_BxUxHxK, v_BxUxHxO, segments_BxS, kv_segments_BxU, scale
            )
        elif kernel == "splash":
            out_BxSxHxO = self._splash(
                q_BxSxHxK, k_BxUxHxK, v_BxUxHxO, segments_BxS, kv_segments_BxU, scale
            )
        else:
            dot_product = self._dot_product
            if c.remat_policy == "selective":
                # Save q, k and v, not the (B, H, S, U) scores and probabilities: the
                # backward recomputes them (as a flash kernel does), a layer at a time.
                dot_product = jax.checkpoint(
                    dot_product, policy=jax.checkpoint_policies.nothing_saveable
                )
            out_BxSxHxO = dot_product(
                q_BxSxHxK, k_BxUxHxK, v_BxUxHxO, positions_BxS, segments_BxS,
                kv_positions_BxU, kv_segments_BxU, scale,
            )  # fmt: skip
        return self._project("bshv,hvd->bsd", out_BxSxHxO, "wo_HxVxD", NAMES.wo, NAMES.out)

    def _dot_product(self, q, k, v, positions_BxS, segments_BxS, kv_pos_BxU, kv_seg_BxU, scale):
        """Attention as einsums and a softmax over materialized (B, H, S, U) scores."""
        ctx = self.ctx
        logits_BxHxSxU = ctx.einsum("bshk,bthk->bhst", q * scale, k, out=NAMES.scores).astype(
            jnp.float32
        )
        causal = positions_BxS[:, None, :, None] >= kv_pos_BxU[:, None, None, :]
        same_doc = segments_BxS[:, None, :, None] == kv_seg_BxU[:, None, None, :]
        logits_BxHxSxU = jnp.where(causal & same_doc, logits_BxHxSxU, -1e30)
        probs_BxHxSxU = jax.nn.softmax(logits_BxHxSxU, axis=-1).astype(self.dtype)
        return ctx.einsum("bhst,bthv->bshv", probs_BxHxSxU, v, out=NAMES.q)

    def _cudnn_flash(self, q, k, v, segments_BxS, kv_seg_BxU, scale, implementation="cudnn"):
        """cuDNN's fused (flash) attention: no (B, H, S, U) scores in memory, causal
        by cuDNN's own mask mode (cudnn_attention.py says how documents and v's head
        dim reach it, and what it falls back to).

        Causal by index and within a document by segment (the packed rows'
        positions restart with each document, so this is the `_dot_product` mask).
        `implementation="xla"` runs the masked call through JAX's reference kernel
        (how the CPU tests check the mask and the padding).
        """
        cudnn = self.cudnn

        def local(q, k, v, seg_q, seg_kv):
            if implementation == "cudnn" and cudnn is not None and cudnn.packed:
                return cudnn_attention.packed(q, k, v, seg_q, scale, cudnn.v_own_dim)
            return cudnn_attention.masked(q, k, v, seg_q, seg_kv, scale, implementation)

        return self._per_shard(local, q, k, v, segments_BxS, kv_seg_BxU)

    def _splash(self, q, k, v, segments_BxS, kv_seg_BxU, scale):
        """Pallas's TPU flash attention (splash_attention.py): causal tiles only, no
        (B, H, S, U) scores in memory; in Pallas's interpreter on a CPU mesh.

        Its pallas_calls declare no varying mesh axes on their outputs, which a
        checked shard_map refuses, so the kernel runs in unchecked ones. JAX never
        differentiates those: a custom VJP runs the forward in one map and, in the
        backward, the kernel's own VJP in another (recomputing the forward from q,
        k and v, so nothing typed inside an unchecked map is carried between them).
        Differentiating an unchecked map would all-reduce q, k and v's cotangents
        over every mesh axis their specs do not name, size-1 axes included."""
        interpret = attention_kernel.splash_interpreted(self.ctx)

        def local(q, k, v, seg_q, seg_kv):
            return splash_attention.attend(q, k, v, seg_q, seg_kv, scale, interpret)

        def local_vjp(q, k, v, seg_q, seg_kv, g):
            _, vjp = jax.vjp(lambda q, k, v: local(q, k, v, seg_q, seg_kv), q, k, v)
            return vjp(g)

        specs = self._specs(q, k)

        def per_shard(fn, in_specs, out_specs):
            # attention_kernel refuses splash in per-device code (the pipeline's stages).
            return jax.shard_map(
                fn, mesh=self.ctx.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )

        forward = per_shard(local, specs, specs[0])
        backward = per_shard(local_vjp, (*specs, specs[0]), specs[:3])

        @jax.custom_vjp
        def attend(q, k, v, seg_q, seg_kv):
            return forward(q, k, v, seg_q, seg_kv)

        def attend_fwd(q, k, v, seg_q, seg_kv):
            return forward(q, k, v, seg_q, seg_kv), (q, k, v, seg_q, seg_kv)

        def attend_bwd(res, g):
            # Segment ids are integers: no cotangent.
            return (*backward(*res, g), None, None)

        attend.defvjp(attend_fwd, attend_bwd)
        return attend(q, k, v, segments_BxS, kv_seg_BxU)

    def _specs(self, q, k):
        """The per-shard specs of (q, k, v, q's segments, kv's segments)."""
        ctx = self.ctx
        q_spec, kv_spec = ctx.spec(NAMES.q, q.shape), ctx.spec(NAMES.kv, k.shape)
        return (q_spec, kv_spec, kv_spec, pt.truncate(q_spec, 2), pt.truncate(kv_spec, 2))

    def _per_shard(self, local, q, k, v, segments_BxS, kv_seg_BxU):
        """A fused kernel on each device's own rows and heads: in a shard_map over
        the activations' specs (batch, heads). An activation carries no tag, and the
        kernel needs no partitioning rule (attention_kernel refuses a sharded
        sequence). In per-device code (the manual pipeline) it is called directly."""
        ctx = self.ctx
        if ctx.manual:
            return local(q, k, v, segments_BxS, kv_seg_BxU)
        specs = self._specs(q, k)
        return jax.shard_map(local, mesh=ctx.mesh, in_specs=specs, out_specs=specs[0])(
            q, k, v, segments_BxS, kv_seg_BxU
        )
