"""The attention kernels: the fused (cuDNN) path's mask, padding and shard_map equal the
dot_product path, checked on CPU through JAX's reference kernel; `attention=` resolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer.config import ConfigError, make_config
from trainer.model import attention_kernel
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
