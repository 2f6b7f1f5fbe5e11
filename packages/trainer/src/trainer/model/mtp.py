"""Multi-token prediction (DeepSeek-V3 technical report, section 2.2).

Depth k = 1..D (`mtp_num_layers`) predicts, at position i, the token k+1 ahead:

    h^0_i = the main model's last hidden state (before its final norm)
    h^k_i = Block_k(eh_proj_k [enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)])
    p^k_i = softmax(Head(head_norm_k(h^k_i)))          predicting t_{i+k+1}

Emb and Head are the main model's own embedding table and output matrix (one
parameter each: autodiff sums their gradients from both uses, so they stay
unreduced through the microbatch loop like every other gradient). The chain is
causal: depth k reads depth k-1's state at the same position and Block_k's
attention is the same causal, document-masked attention as the main layers.

Parameters, stacked over depth on a leading 'layers' axis under `mtp/`
(index k-1 is depth k; in DeepSeek-V3's checkpoint, layer num_hidden_layers+k-1):

    enorm/scale (D, d)       RMSNorm of the embedding of t_{i+k}       (enorm)
    hnorm/scale (D, d)       RMSNorm of h^{k-1}                        (hnorm)
    eh_proj_2xDxD (D, 2, d, d)  [0]: embedding half, [1]: hidden half  (eh_proj.weight,
                             (d, 2d) = [e | h] columns, transposed)
    block/...               one decoder block, dense or MoE as the main model's
                             later layers                              (the layer's own weights)
    head_norm/scale (D, d)   RMSNorm before the shared head            (shared_head.norm)

The checkpoint's shared_head.head and embed_tokens copies are the main model's
`logits_DxV` and `embedding_VxD`: no copies here.

The two halves of eh_proj are one (2, d, d) weight contracted against the two
normed inputs stacked on a new axis: the same product as a (2d, d) projection of
their concatenation, with no concatenate of (possibly sharded) embed dims.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config import ModelConfig
from trainer.model.layers import BSE, RMSNorm
from trainer.model.params import param
from trainer.sharding import ShardCtx


@dataclasses.dataclass(frozen=True)
class MTPNames:
    """Logical axis names of the MTP projection and the token-id shifts."""

    eh_proj: tuple = (None, "embed", None)
    halves: tuple = ("activation_batch", "activation_length", None, "activation_embed")
    tokens: tuple = ("activation_batch", "activation_length")
    # Token ids with the sequence gathered whole, so a shift along it is local.
    whole_rows: tuple = ("activation_batch", None)


NAMES = MTPNames()


class MTPLayer(nnx.Module):
    """One depth: norms, the 2d -> d projection, its block, and its head norm."""

    def __init__(self, config: ModelConfig, ctx: ShardCtx, block: nnx.Module, *, rngs: nnx.Rngs):
        d, eps = config.emb_dim, config.normalization_layer_epsilon
        self.enorm = RMSNorm(d, eps, rngs=rngs)
        self.hnorm = RMSNorm(d, eps, rngs=rngs)
        self.eh_proj_2xDxD = param(rngs, (2, d, d), NAMES.eh_proj, fan_in=2 * d)
        self.block = block
        self.head_norm = RMSNorm(d, eps, rngs=rngs)
        self.ctx, self.dtype = ctx, jnp.dtype(config.dtype)

    def __call__(self, h_BxSxD, e_BxSxD, positions_BxS, segments_BxS):
        """(h^k, the block's MoE stats) from h^{k-1} and the embedding of t_{i+k}."""
        ctx = self.ctx
        normed_BxSx2xD = ctx.act(
            jnp.stack([self.enorm(e_BxSxD), self.hnorm(h_BxSxD)], axis=2), NAMES.halves
        )
        x_BxSxD = ctx.einsum(
            "bstd,tde->bse",
            normed_BxSx2xD,
            ctx.weight(self.eh_proj_2xDxD[...].astype(self.dtype), NAMES.eh_proj),
            out=BSE,
        )
        return self.block(x_BxSxD, positions_BxS, segments_BxS)


def shift_left(x_BxS: jax.Array, k: int, ctx: ShardCtx, fill=0) -> jax.Array:
    """x[:, i + k] at position i, `fill` where i + k runs past the sequence end.

    Only token-sized (B x S) arrays are shifted: the sequence is gathered whole
    first (under context parallelism it is sharded), shifted, and laid out like
    the tokens again.
    """
    whole_BxS = ctx.relayout(x_BxS, NAMES.tokens, NAMES.whole_rows)
    shifted_BxS = jnp.pad(whole_BxS[:, k:], ((0, 0), (0, k)), constant_values=fill)
    return ctx.relayout(shifted_BxS, NAMES.whole_rows, NAMES.tokens)


def depth_targets(batch: dict, k: int, ctx: ShardCtx) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(inputs, targets, weights) of depth k: the embedding input t_{i+k}, the target
    t_{i+k+1}, and its weight, zero at the sequence end and wherever i and i + k lie
    in different packed segments (no prediction crosses a document)."""
    inputs_BxS = shift_left(batch["inputs"], k, ctx)
    targets_BxS = shift_left(batch["targets"], k, ctx)
    # Segment -1 past the end: never equal to a real one (padding is 0).
    same_doc_BxS = shift_left(batch["segments"], k, ctx, fill=-1) == batch["segments"]
    weights_BxS = shift_left(batch["weights"], k, ctx) * same_doc_BxS.astype(jnp.float32)
    return inputs_BxS, targets_BxS, weights_BxS
