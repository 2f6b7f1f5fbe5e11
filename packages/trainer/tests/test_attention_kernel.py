"""The attention kernels: the fused (cuDNN) path's mask, padding and shard_map equal the
dot_product path, checked on CPU through JAX's reference kernel; the packed layout's
documents equal the segment mask; `attention=` resolution; rope on q's tail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer.config import ConfigError, make_config
from trainer.model import attention_kernel, cudnn_attention
from trainer.model import rope as rope_lib
from trainer.model.attention import MLA, NAMES
from trainer.sharding import ShardCtx, logical_rules, make_mesh


def _ctx(config, sizes):
    mesh = make_mesh(sizes, config.shard_mode, jax.devices()[: int(np.prod(list(sizes.values())))])
    return ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)


@pytest.mark.parametrize("shard_mode", ["explicit", "auto"])
def test_fused_path_equals_dot_product_on_packed_rows(shard_mode):
    config = make_config({"model_name": "tagtrain-tiny", "shard_mode": shard_mode})
    ctx = _ctx(config, {"data": 4, "tensor": 2})
    attn = MLA(config.model, ctx, rngs=nnx.Rngs(0))
    c = config.model
    b, s, h = 8, 16, c.base_num_query_heads
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, c.qk_head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, h, c.qk_head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, h, c.v_head_dim), jnp.bfloat16)
    # Two documents per row, the second starting at a row-dependent offset:
    # positions restart at each document, as the packed text pipeline writes them.
    starts = np.arange(b) % (s - 2) + 1
    idx = np.arange(s)[None]
    segments = (idx >= starts[:, None]).astype(np.int32)
    positions = np.where(segments == 0, idx, idx - starts[:, None]).astype(np.int32)
    scale = c.qk_head_dim**-0.5

    with jax.set_mesh(ctx.mesh):
        put = lambda x, names: jax.device_put(x, ctx.sharding(names, x.shape))  # noqa: E731
        q, k, v = put(q, NAMES.q), put(k, NAMES.kv), put(v, NAMES.kv)
        seg, pos = put(segments, NAMES.q[:2]), put(positions, NAMES.q[:2])
        want = jax.jit(attn._dot_product)(q, k, v, pos, seg, pos, seg, scale)
        got = jax.jit(lambda *a: attn._cudnn_flash(*a, implementation="xla"))(
            q, k, v, seg, seg, scale
        )
    assert got.shape == want.shape == (b, s, h, c.v_head_dim)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )


def test_auto_is_dot_product_off_gpu_and_cudnn_flash_is_refused_naming_the_key():
    config = make_config({"model_name": "tagtrain-tiny"})
    ctx = _ctx(config, {"data": 8})
    assert attention_kernel.choose_kernel(config.model, ctx) == "dot_product"
    forced = make_config({"model_name": "tagtrain-tiny", "attention": "cudnn_flash"})
    with pytest.raises(ConfigError, match=r"attention=cudnn_flash cannot run here: .*not GPUs"):
        attention_kernel.choose_kernel(forced.model, ctx)


def test_blockers_name_dtype_head_dim_and_context_parallelism():
    config = make_config(
        {
            "model_name": "tagtrain-tiny",
            "dtype": "float32",
            "qk_nope_head_dim": "128",
            "ici_context_parallelism": "2",
        }
    )
    ctx = _ctx(config, {"data": 4, "context": 2})
    blockers = " | ".join(attention_kernel.cudnn_flash_blockers(config.model, ctx))
    assert "dtype=float32" in blockers
    assert "head dim 136 > 128" in blockers
    assert "context parallelism" in blockers


def _mask_of_documents(lengths, offsets, s):
    """The (B, S, S) same-document mask cuDNN's packed layout means (causality aside)."""
    doc = np.full((lengths.shape[0], s), -1)
    for b in range(lengths.shape[0]):
        for m in range(lengths.shape[1]):
            if lengths[b, m] >= 0:
                doc[b, offsets[b, m] : offsets[b, m] + lengths[b, m]] = m
    return doc[:, :, None] == doc[:, None, :], doc


def test_packed_documents_are_the_segment_mask():
    # Row 0: one document; row 1: three and trailing padding (id 0, its own run);
    # row 2: documents 1, 2, 3 of lengths 5, 1, 10.
    s = 16
    segments = np.array(
        [[1] * s, [1] * 4 + [2] * 3 + [3] * 5 + [0] * 4, [1] * 5 + [2] + [3] * 10], np.int32
    )
    lengths, offsets, fits = (np.asarray(x) for x in cudnn_attention.documents(segments, 4))
    assert bool(fits)
    assert lengths.tolist() == [[16, -1, -1, -1], [4, 3, 5, 4], [5, 1, 10, -1]]
    assert offsets.tolist() == [[0, -1, -1, -1, -1], [0, 4, 7, 12, -1], [0, 5, 6, -1, -1]]
    same, doc = _mask_of_documents(lengths, offsets, s)
    assert (doc >= 0).all()  # every token in some document
    np.testing.assert_array_equal(same, segments[:, :, None] == segments[:, None, :])
    # A row of more documents than the packed call's slots takes the masked call.
    _, _, fits = cudnn_attention.documents(segments, 3)
    assert not bool(fits)


def test_rope_rotates_only_the_dims_after_start():
    config = make_config({"model_name": "tagtrain-tiny"}).model
    nope, r = config.qk_nope_head_dim, config.qk_rope_head_dim
    x = jax.random.normal(jax.random.key(0), (2, 8, 2, nope + r), jnp.float32)
    pos = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    got = rope_lib.rope(x, pos, config, start=nope)
    want = jnp.concatenate([x[..., :nope], rope_lib.rope(x[..., nope:], pos, config)], -1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got[..., :nope]), np.asarray(x[..., :nope]))
    assert not np.allclose(np.asarray(got[:, 1:, :, nope:]), np.asarray(x[:, 1:, :, nope:]))
