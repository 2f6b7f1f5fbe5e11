"""ShardCtx in a fully manual region (the pipeline's stages and ends). Tensor
parallelism: `einsum` psums over 'tensor' exactly the results that are partial sums,
and the gradients of split and whole weights come out as the unsplit computation's.
Context parallelism: `relayout` gathers a sequence chunk whole and slices it back,
so attention's keys and the MTP shift see the whole sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from trainer.config import make_config
from trainer.model.attention import NAMES
from trainer.model.attention_kernel import cudnn_flash_blockers, splash_blockers
from trainer.model.layers import BSE
from trainer.model.mtp import NAMES as MTP_NAMES
from trainer.model.mtp import shift_left
from trainer.sharding import ShardCtx, logical_rules, make_mesh

B, S, D, H, K = 4, 3, 8, 4, 2


@pytest.fixture(scope="module")
def setup():
    config = make_config({"ici_tensor_parallelism": "2", "ici_data_parallelism": "4"})
    mesh = make_mesh({"data": 4, "tensor": 2}, "explicit")
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), "manual")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    w_in = jnp.asarray(rng.normal(size=(D, H, K)), jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(H, K, D)), jnp.float32)
    w_whole = jnp.asarray(rng.normal(size=(D, D)), jnp.float32)
    return mesh, ctx, (x, w_in, w_out, w_whole)


def _loss_reference(x, w_in, w_out, w_whole):
    h = jnp.einsum("bsd,dhk->bshk", x, w_in)
    y = jnp.einsum("bshk,hkd->bsd", h, w_out)
    z = jnp.einsum("bsd,de->bse", y, w_whole)  # a weight whole over 'tensor'
    return jnp.sum(z * z)


def _loss_manual(mesh, ctx):
    def per_device(x, w_in, w_out, w_whole):
        # Column split (heads on 'tensor': a shard, no sum), row split (the heads
        # contracted: partial sums, psummed), then a whole weight (invariant: no sum).
        h = ctx.einsum("bsd,dhk->bshk", x, w_in, out=NAMES.q)
        y = ctx.einsum("bshk,hkd->bsd", h, w_out, out=NAMES.out)
        z = ctx.einsum("bsd,de->bse", y, w_whole, out=BSE)
        return jax.lax.psum(jnp.sum(z * z), "data")

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P("data"), P(None, "tensor"), P("tensor"), P()),
        out_specs=P(),
    )
    return mapped


def test_row_split_contraction_is_summed_once(setup):
    mesh, ctx, args = setup
    with jax.set_mesh(mesh):
        placed = [
            jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
            for a, s in zip(args, (P("data"), P(None, "tensor"), P("tensor"), P()), strict=True)
        ]
        got = jax.jit(_loss_manual(mesh, ctx))(*placed)
    np.testing.assert_allclose(float(got), float(_loss_reference(*args)), rtol=1e-5)


def test_gradients_of_split_and_whole_weights(setup):
    mesh, ctx, args = setup
    specs = (P("data"), P(None, "tensor"), P("tensor"), P())
    with jax.set_mesh(mesh):
        placed = [
            jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
            for a, s in zip(args, specs, strict=True)
        ]
        got = jax.jit(jax.grad(_loss_manual(mesh, ctx), argnums=(0, 1, 2, 3)))(*placed)
    want = jax.grad(_loss_reference, argnums=(0, 1, 2, 3))(*args)
    for name, g, w in zip(("x", "w_in", "w_out", "w_whole"), got, want, strict=True):
        # A whole weight's gradient psummed over 'tensor' would come out doubled; a
        # missing psum of x's cotangent would leave half of it.
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, err_msg=name)


def test_no_sum_without_a_tensor_axis():
    # The floor step's manual ctx (tensor of size one): the einsum is a plain einsum.
    config = make_config({"ici_data_parallelism": "8"})
    mesh = make_mesh({"data": 8}, "explicit")
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), "manual")
    x = jnp.ones((2, 3, 4))
    w = jnp.ones((4, 4))

    def per_device(x, w):
        return ctx.einsum("bsd,de->bse", x, w, out=BSE)

    out = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P()), out_specs=P())(x, w)
    np.testing.assert_allclose(np.asarray(out), 4.0)


@pytest.fixture(scope="module")
def context_ctx():
    config = make_config({"ici_context_parallelism": "4", "ici_data_parallelism": "2"})
    mesh = make_mesh({"data": 2, "context": 4}, "explicit")
    return mesh, ShardCtx(mesh, logical_rules(config.parallelism), "manual"), config


def test_relayout_gathers_the_sequence_and_slices_it_back(context_ctx):
    mesh, ctx, _ = context_ctx
    tokens_BxS = jnp.arange(4 * 8, dtype=jnp.int32).reshape(4, 8)

    def per_device(x_BxS):
        whole = ctx.relayout(x_BxS, MTP_NAMES.tokens, MTP_NAMES.whole_rows)
        back = ctx.relayout(whole, MTP_NAMES.whole_rows, MTP_NAMES.tokens)
        return whole[None], back

    spec = P("data", "context")
    whole, back = jax.shard_map(
        per_device, mesh=mesh, in_specs=spec, out_specs=(P("context", "data", None), spec)
    )(jax.device_put(tokens_BxS, jax.sharding.NamedSharding(mesh, spec)))
    # Each device's chunk of 2 positions gathered into its rows' whole 8 (on every
    # context device alike), and sliced back to exactly its chunk.
    for on_device in np.asarray(whole):
        np.testing.assert_array_equal(on_device, np.asarray(tokens_BxS))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(tokens_BxS))


def test_mtp_shift_crosses_the_sequence_chunks(context_ctx):
    mesh, ctx, _ = context_ctx
    tokens_BxS = jnp.arange(4 * 8, dtype=jnp.int32).reshape(4, 8)
    spec = P("data", "context")
    shifted = jax.shard_map(
        lambda x: shift_left(x, 1, ctx, fill=-1), mesh=mesh, in_specs=spec, out_specs=spec
    )(jax.device_put(tokens_BxS, jax.sharding.NamedSharding(mesh, spec)))
    want = np.concatenate([np.asarray(tokens_BxS)[:, 1:], -np.ones((4, 1), np.int32)], 1)
    # A per-chunk shift would pad every chunk's last position instead of reading the
    # next chunk's first token.
    np.testing.assert_array_equal(np.asarray(shifted), want)


def test_fused_attention_refused_on_a_sequence_chunk(context_ctx):
    _, ctx, config = context_ctx
    # A fused kernel's causal mask by index would ignore the chunk's offset.
    assert "the sequence is sharded (context parallelism)" in cudnn_flash_blockers(
        config.model, ctx
    )
    assert "the sequence is sharded (context parallelism)" in splash_blockers(config.model, ctx)
