"""MLA's KV cache and attention over it, in DeepSeek's absorbed form.

Per layer and token the cache holds what MLA compresses the keys and values into
(DeepSeek-V2 section 2.1, and DeepSeek-V3's inference code): the latent
`kv_norm(x W_kv_a)[:kv_lora_rank]` [B, L, C] and the shared rotary key
`rope(x W_kv_a)[kv_lora_rank:]` [B, L, R], C + R numbers per token instead of
H * (K + V) for expanded keys and values.

Attention never expands the cache: `W_kv_b` [C, H, N + V] is split into the key
half W_uk [C, H, N] and the value half W_uv [C, H, V] and absorbed,

    q_nope . k_nope = q_nope . (latent W_uk) = (q_nope W_uk^T) . latent
    out = probs (latent W_uv) = (probs latent) W_uv,

so the scores are (q_nope W_uk^T) . latent + q_rope . rope_key, and the weighted
latent goes through W_uv and then W_o. The same numbers as the training forward
(model/attention.py), in another order: equal up to rounding.

Slots: the cache has L slots per row; a forward writes its S tokens at slots
[write_index, write_index + S) of every row. Rows are left-padded: row b's first
real token sits at slot `start_B[b]`, and its position (for RoPE) is the slot
minus `start_B[b]`. A query at slot s sees the slots [start_B[b], s].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.config import ModelConfig
from trainer.model.attention import MLA
from trainer.model.rope import rope, softmax_scale

LATENT, ROPE_KEY = "latent", "rope_key"


def layer_cache(config: ModelConfig, layers: int, batch: int, length: int) -> dict:
    """Zeros for `layers` stacked layers: latent [layers, B, L, C] and rope_key
    [layers, B, L, R], in the compute dtype (the training forward's own
    rounding of both)."""
    dtype = jnp.dtype(config.dtype)
    return {
        LATENT: jnp.zeros((layers, batch, length, config.kv_lora_rank), dtype),
        ROPE_KEY: jnp.zeros((layers, batch, length, config.qk_rope_head_dim), dtype),
    }


def visible(start_B: jax.Array, write_index, queries: int, length: int) -> jax.Array:
    """[B, S, L]: whether the query at slot write_index + s sees slot t (causal, and
    not in the row's left padding)."""
    slot_L = jnp.arange(length)
    query_slot_S = write_index + jnp.arange(queries)
    causal_SxL = slot_L[None, :] <= query_slot_S[:, None]
    real_BxL = slot_L[None, :] >= start_B[:, None]
    return causal_SxL[None] & real_BxL[:, None, :]


def _write(cache_BxLxF: jax.Array, new_BxSxF: jax.Array, write_index) -> jax.Array:
    return jax.lax.dynamic_update_slice(
        cache_BxLxF, new_BxSxF.astype(cache_BxLxF.dtype), (0, write_index, 0)
    )


def attend(
    attn: MLA,
    x_BxSxD: jax.Array,
    positions_BxS: jax.Array,
    cache: dict,
    write_index,
    visible_BxSxL: jax.Array,
) -> tuple[jax.Array, dict]:
    """MLA of `attn`'s weights on S new tokens against the cache: (output [B, S, D],
    the cache with the new tokens' latent and rope key written).

    Generation runs on one device, so the contractions here are plain einsums (no
    logical shardings to name); the query path is the layer's own.
    """
    c, dt = attn.config, attn.dtype
    nope, rank = c.qk_nope_head_dim, c.kv_lora_rank
    q_BxSxHxK = attn._queries(x_BxSxD)  # the training forward's own query path
    q_nope_BxSxHxN = q_BxSxHxK[..., :nope]
    q_rope_BxSxHxR = rope(q_BxSxHxK[..., nope:], positions_BxS, c)

    kv_BxSxCR = jnp.einsum("bsd,dc->bsc", x_BxSxD, attn.wkv_a_DxCR[...].astype(dt))
    latent_BxSxC = attn.kv_norm(kv_BxSxCR[..., :rank])
    rope_key_BxSxR = rope(kv_BxSxCR[:, :, None, rank:], positions_BxS, c)[:, :, 0, :]
    cache = {
        LATENT: _write(cache[LATENT], latent_BxSxC, write_index),
        ROPE_KEY: _write(cache[ROPE_KEY], rope_key_BxSxR, write_index),
    }

    wkv_b_CxHxNV = attn.wkv_b_CxHxNV[...].astype(dt)
    w_uk_CxHxN, w_uv_CxHxV = wkv_b_CxHxNV[..., :nope], wkv_b_CxHxNV[..., nope:]
    # Absorbed key half: the query meets the latent directly (no per-head keys).
    q_latent_BxSxHxC = jnp.einsum("bshn,chn->bshc", q_nope_BxSxHxN, w_uk_CxHxN)
    scores_BxHxSxL = jnp.einsum("bshc,btc->bhst", q_latent_BxSxHxC, cache[LATENT]).astype(
        jnp.float32
    ) + jnp.einsum("bshr,btr->bhst", q_rope_BxSxHxR, cache[ROPE_KEY]).astype(jnp.float32)
    # qk_head_dim^-0.5, with YaRN's mscale correction: the training forward's scale.
    scores_BxHxSxL = jnp.where(visible_BxSxL[:, None], scores_BxHxSxL * softmax_scale(c), -1e30)
    probs_BxHxSxL = jax.nn.softmax(scores_BxHxSxL, axis=-1).astype(dt)
    # Absorbed value half: weight the latents, then expand once per query.
    mixed_BxSxHxC = jnp.einsum("bhst,btc->bshc", probs_BxHxSxL, cache[LATENT])
    out_BxSxHxV = jnp.einsum("bshc,chv->bshv", mixed_BxSxHxC, w_uv_CxHxV)
    out_BxSxD = jnp.einsum("bshv,hvd->bsd", out_BxSxHxV, attn.wo_HxVxD[...].astype(dt))
    return out_BxSxD, cache
