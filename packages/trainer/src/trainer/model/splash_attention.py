"""TPU flash attention for MLA: Pallas's splash kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`).

No (B, H, S, U) scores in memory: the kernel walks (q tile, kv tile) pairs and skips
the tiles above the diagonal; its backward recomputes the scores from q, k, v and the
saved log-sum-exp (a few bytes per row). What MLA gives it:

- the mask: causal by index (splash's CausalMask) and within a document by segment
  ids. A packed row's positions restart with each document, so "same document and
  index <= index" is `_dot_product`'s "same document and position <= position";
- q and k at MLA's qk head dim, v at its own (the kernel takes head_dim_v !=
  head_dim_qk: no zero-padded v);
- the softmax scale folded into q (the kernel applies none);
- one row at a time: the kernel maps (H, S, K); the batch is a vmap over rows;
- per device, in an unchecked shard_map: its pallas_calls declare outputs with no
  varying mesh axes, which JAX's varying-axes checks refuse. So not inside the
  pipeline's manual map, whose checks carry the gradients' tags
  (attention_kernel refuses it there).

Tiles: the largest of 512 (MaxText's default on TPU), 256, 128 that divides the
sequence (attention_kernel.SPLASH_TILE says why 128 is the floor). Off TPU (attention
=splash by name on a CPU mesh) the kernel runs in Pallas's interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# `jax.experimental.pallas.ops.tpu.splash_attention` is imported on first use (in
# `_kernel`), not at import time: it pulls in Pallas's TPU lowering.

# Largest first; the smallest is the floor attention_kernel checks (SPLASH_TILE).
TILES = (512, 256, 128)


def tile(seq_len: int) -> int:
    """The q and kv tile for a sequence (attention_kernel checks it divides)."""
    return next((t for t in TILES if seq_len % t == 0), seq_len)


def _kernel(heads: int, seq_len: int, kv_len: int, interpret: bool):
    """The splash kernel for (heads, S, U): causal, tiles of `tile`."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    bq, bkv = tile(seq_len), tile(kv_len)
    blocks = sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((seq_len, kv_len))] * heads)
    # Built in each trace, inside the shard_map: its mask tables are that trace's
    # constants (cached arrays would carry another trace's mesh, or none that an AOT
    # topology compile can place).
    return sa.make_splash_mha(
        mask, head_shards=1, q_seq_shards=1, block_sizes=blocks, interpret=interpret
    )


def attend(q_BxSxHxK, k_BxUxHxK, v_BxUxHxV, seg_BxS, seg_BxU, scale, interpret=False):
    """Causal, per-document attention of one device's rows and heads: out_BxSxHxV.

    Per device, in a shard_map with check_vma=False (model/attention.py): Splash's
    pallas_calls declare their outputs with no varying mesh axes, which a checked
    shard_map refuses. `interpret`: Pallas's interpreter (a CPU mesh),
    not Mosaic (TPUs, a compile-only topology's included)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    _, s, h, _ = q_BxSxHxK.shape
    kernel = _kernel(h, s, k_BxUxHxK.shape[1], interpret)

    def rows(q_BxSxHxK, k_BxUxHxK, v_BxUxHxV, seg_BxS, seg_BxU):
        # The kernel's layout is (H, S, K) per row: heads before positions.
        q_BxHxSxK = jnp.swapaxes(q_BxSxHxK * jnp.asarray(scale, q_BxSxHxK.dtype), 1, 2)
        k_BxHxUxK = jnp.swapaxes(k_BxUxHxK, 1, 2)
        v_BxHxUxV = jnp.swapaxes(v_BxUxHxV, 1, 2)

        def row(q, k, v, seg_q, seg_kv):
            return kernel(q, k, v, segment_ids=sa.SegmentIds(q=seg_q, kv=seg_kv))

        out_BxHxSxV = jax.vmap(row)(q_BxHxSxK, k_BxHxUxK, v_BxHxUxV, seg_BxS, seg_BxU)
        return jnp.swapaxes(out_BxHxSxV, 1, 2)

    return rows(q_BxSxHxK, k_BxUxHxK, v_BxUxHxV, seg_BxS, seg_BxU)
