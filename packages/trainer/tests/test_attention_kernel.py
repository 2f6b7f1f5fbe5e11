"""The attention kernels: the fused (cuDNN) path's mask, padding and shard_map equal the
dot_product path, checked on CPU through JAX's reference kernel; splash (Pallas's TPU
kernel, in its interpreter on CPU) equals dot_product forward and backward; the packed
layout's documents equal the segment mask; `attention=` resolution; rope on q's tail."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hlo_tools
from trainer.config import ConfigError, make_config
from trainer.model import attention_kernel, cudnn_attention
from trainer.model import rope as rope_lib
from trainer.model.attention import MLA, NAMES
from trainer.sharding import ShardCtx, logical_rules, make_mesh


def _ctx(config, sizes):
    mesh = make_mesh(sizes, config.shard_mode, jax.devices()[: int(np.prod(list(sizes.values())))])
    return ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)


def _packed_rows(c, b, s, dtype, stride=None):
    """Random q, k, v and two documents per row, the second starting at a
    row-dependent offset: positions restart at each document, as the packed text
    pipeline writes them. (q, k, v, segments, positions, scale)."""
    h = c.base_num_query_heads
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, c.qk_head_dim), dtype)
    k = jax.random.normal(keys[1], (b, s, h, c.qk_head_dim), dtype)
    v = jax.random.normal(keys[2], (b, s, h, c.v_head_dim), dtype)
    starts = (np.arange(b) * (stride or 1)) % (s - 2) + 1
    idx = np.arange(s)[None]
    segments = (idx >= starts[:, None]).astype(np.int32)
    positions = np.where(segments == 0, idx, idx - starts[:, None]).astype(np.int32)
    return q, k, v, segments, positions, c.qk_head_dim**-0.5


def _collective_kinds(text):
    """(kind, in a loop, bytes) of every collective of a compiled program, sorted."""
    return sorted((c.kind, c.in_loop, c.bytes) for c in hlo_tools.collectives(text))


def _put_all(ctx, q, k, v, segments, positions):
    put = lambda x, names: jax.device_put(x, ctx.sharding(names, x.shape))  # noqa: E731
    return (
        put(q, NAMES.q), put(k, NAMES.kv), put(v, NAMES.kv),
        put(segments, NAMES.q[:2]), put(positions, NAMES.q[:2]),
    )  # fmt: skip


@pytest.mark.parametrize("shard_mode", ["explicit", "auto"])
def test_fused_path_equals_dot_product_on_packed_rows(shard_mode):
    config = make_config({"model_name": "tagtrain-tiny", "shard_mode": shard_mode})
    ctx = _ctx(config, {"data": 4, "tensor": 2})
    attn = MLA(config.model, ctx, rngs=nnx.Rngs(0))
    c = config.model
    b, s, h = 8, 16, c.base_num_query_heads
    q, k, v, segments, positions, scale = _packed_rows(c, b, s, jnp.bfloat16)

    with jax.set_mesh(ctx.mesh):
        q, k, v, seg, pos = _put_all(ctx, q, k, v, segments, positions)
        want = jax.jit(attn._dot_product)(q, k, v, pos, seg, pos, seg, scale)
        got = jax.jit(lambda *a: attn._cudnn_flash(*a, implementation="xla"))(
            q, k, v, seg, seg, scale
        )
    assert got.shape == want.shape == (b, s, h, c.v_head_dim)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("shard_mode", ["explicit", "auto"])
def test_splash_equals_dot_product_forward_and_backward(shard_mode):
    # Pallas's TPU kernel in its interpreter, per shard of a data x tensor mesh; f32
    # so the two paths agree to rounding. Rows of 256 positions: two 128-row tiles,
    # so the causal mask skips a tile and the documents cross tile edges.
    config = make_config(
        {
            "model_name": "tagtrain-tiny",
            "shard_mode": shard_mode,
            "attention": "splash",
            "dtype": "float32",
        }
    )
    ctx = _ctx(config, {"data": 2, "tensor": 2})
    attn = MLA(config.model, ctx, rngs=nnx.Rngs(0))
    assert attn.kernel == "splash"
    c = config.model
    q, k, v, segments, positions, scale = _packed_rows(c, 2, 256, jnp.float32, stride=150)

    def loss(fn):
        # A fixed random cotangent, so every output element's gradient counts.
        w = jax.random.normal(jax.random.key(1), (2, 256, c.base_num_query_heads, c.v_head_dim))
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    with jax.set_mesh(ctx.mesh):
        q, k, v, seg, pos = _put_all(ctx, q, k, v, segments, positions)
        dot = lambda q, k, v: attn._dot_product(q, k, v, pos, seg, pos, seg, scale)  # noqa: E731
        splash = lambda q, k, v: attn._splash(q, k, v, seg, seg, scale)  # noqa: E731
        want, got = jax.jit(dot)(q, k, v), jax.jit(splash)(q, k, v)
        want_grad = jax.jit(jax.grad(loss(dot), (0, 1, 2))).lower(q, k, v).compile()
        got_grad = jax.jit(jax.grad(loss(splash), (0, 1, 2))).lower(q, k, v).compile()
        want_grads, got_grads = want_grad(q, k, v), got_grad(q, k, v)
    # The backward adds no collective of its own (a differentiated unchecked
    # shard_map would all-reduce q, k and v's cotangents): only the loss's sum.
    assert _collective_kinds(got_grad.as_text()) == _collective_kinds(want_grad.as_text())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4, err_msg=name)


def test_auto_is_dot_product_off_gpu_and_cudnn_flash_is_refused_naming_the_key():
    config = make_config({"model_name": "tagtrain-tiny"})
    ctx = _ctx(config, {"data": 8})
    assert attention_kernel.choose_kernel(config.model, ctx) == "dot_product"
    forced = make_config({"model_name": "tagtrain-tiny", "attention": "cudnn_flash"})
    with pytest.raises(ConfigError, match=r"attention=cudnn_flash cannot run here: .*not GPUs"):
        attention_kernel.choose_kernel(forced.model, ctx)


def test_splash_is_chosen_by_name_on_cpu_and_refused_where_it_cannot_tile():
    config = make_config({"model_name": "tagtrain-tiny", "attention": "splash"})
    ctx = _ctx(config, {"data": 8})
    # By name on CPU devices: Pallas's interpreter (auto keeps dot_product there).
    assert attention_kernel.choose_kernel(config.model, ctx, 256) == "splash"
    assert "interpreted" in attention_kernel.describe(config.model, ctx, 256)
    with pytest.raises(ConfigError, match=r"attention=splash .*max_target_length=100 .*128"):
        attention_kernel.choose_kernel(config.model, ctx, 100)
    context = make_config(
        {"model_name": "tagtrain-tiny", "attention": "splash", "ici_context_parallelism": "2"}
    )
    with pytest.raises(ConfigError, match=r"attention=splash .*context parallelism"):
        attention_kernel.choose_kernel(context.model, _ctx(context, {"data": 4, "context": 2}))
    auto = make_config({"model_name": "tagtrain-tiny"})
    line = attention_kernel.describe(auto.model, ctx, 256)
    assert line.startswith("attention: dot_product (not cudnn_flash: ")
    assert "not splash: the mesh's devices are ['cpu'], not TPUs" in line


def test_splash_is_refused_in_per_device_code_and_auto_keeps_dot_product_there():
    # The pipeline's stages run per-device code inside a checked manual map, where
    # splash's pallas_calls cannot run (splash_attention.py says why).
    config = make_config({"model_name": "tagtrain-tiny", "attention": "splash"})
    manual = dataclasses.replace(_ctx(config, {"data": 8}), mode="manual")
    with pytest.raises(ConfigError, match=r"attention=splash .*pipeline's stages"):
        attention_kernel.choose_kernel(config.model, manual, 256)
    auto = make_config({"model_name": "tagtrain-tiny"})
    assert attention_kernel.choose_kernel(auto.model, manual, 256) == "dot_product"


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


@pytest.mark.slow
def test_a_splash_step_trains_like_dot_product_with_the_same_collectives(
    runner, grads_runner, grads_match
):
    # The trainer's step (f32, data=4 x tensor=2, GA=2, deferred reduction) with the
    # kernel in Pallas's interpreter: the same losses and gradients as dot_product,
    # and the same collectives, where they run included. A differentiated unchecked
    # shard_map would add all-reduces of q, k and v's cotangents inside the loop.
    overrides = dict(
        max_target_length="128",
        gradient_accumulation_steps="2",
        gradient_reduction_policy="deferred",
        ici_tensor_parallelism="2",
    )
    want, want_text = runner(1, attention="dot_product", **overrides)
    got, got_text = runner(1, attention="splash", **overrides)
    np.testing.assert_allclose([h["loss"] for h in got], [h["loss"] for h in want], rtol=1e-5)
    grads_match(
        grads_runner(1, attention="splash", **overrides),
        grads_runner(1, attention="dot_product", **overrides),
        rtol=1e-4,
    )
    assert _collective_kinds(got_text) == _collective_kinds(want_text)
    assert "tpu_custom_call" not in got_text  # interpreted on CPU: no Mosaic kernel


@pytest.mark.aot
def test_a_tpu_compile_picks_splash_with_the_same_collectives_and_a_lower_peak(tmp_path):
    # attention=auto on a TPU topology (compiled on this host: Mosaic runs in libtpu):
    # splash, whose program holds Pallas kernels and the same collectives as
    # dot_product's, every gradient still reduced once per step, and a lower peak
    # (no (B, H, S, S) scores).
    pytest.importorskip("libtpu", reason="needs the tpu extra (libtpu): uv run --extra tpu")
    from trainer.run import aot
    from trainer_tests_layouts import AOT_TEST_V5E8

    base = {**AOT_TEST_V5E8, "max_target_length": "512", "base_output_directory": str(tmp_path)}
    splash = aot.compile_for_topology(make_config(base))
    dot = aot.compile_for_topology(make_config({**base, "attention": "dot_product"}))
    assert "attention: splash (Pallas on TPU" in "\n".join(aot.report_lines(splash))
    text = splash.compiled.as_text()
    assert 'custom_call_target="tpu_custom_call"' in text
    hlo_tools.assert_reduced_once_per_step(text)
    assert _collective_kinds(text) == _collective_kinds(dot.compiled.as_text())
    assert splash.memory["peak"] < dot.memory["peak"]
