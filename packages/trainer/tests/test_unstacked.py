"""model.unstacked: the stacked layer groups split into their layers once, read by the
unrolled layer loop without slicing the stacks (the train step's accum `prepare` on
unrolled layers with gradient accumulation, issue 53). Same logits, same gradients
(pulled back to the stacked parameters) as the stacked parameters give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import model as model_lib
from trainer.config import make_config
from trainer.config.validate import validate
from trainer.model.decoder import LayerViews
from trainer.sharding import ShardCtx, logical_rules, make_mesh


@pytest.fixture(scope="module")
def tiny():
    config = make_config({"model_name": "tagtrain-tiny", "scan_layers": "false"})
    sizes = validate(config, 1)  # one device: the split is per layer, not per shard
    ctx = ShardCtx(make_mesh(sizes, "explicit"), logical_rules(config.parallelism), "explicit")
    model_def = model_lib.define(config.model, ctx)
    with jax.set_mesh(ctx.mesh):
        params, router = model_lib.init(ctx, model_def, seed=0)
    rows, length = 8, config.data.max_target_length
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (rows, length))
    positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
    segments = np.ones((rows, length), np.int32)
    return ctx, model_def, params, router, (jnp.asarray(tokens, jnp.int32), positions, segments)


def test_unstacked_splits_the_stacked_groups_only(tiny):
    _, _, params, _, _ = tiny
    views = model_lib.unstacked(params)
    stacked = [k for k in params if k in model_lib.STACKS]
    assert stacked  # tagtrain-tiny has a dense and an MoE stack
    for key, group in params.items():
        leaves = jax.tree.leaves(views[key], is_leaf=lambda x: isinstance(x, LayerViews))
        if key in model_lib.STACKS:
            for stack, view in zip(jax.tree.leaves(group), leaves, strict=True):
                assert isinstance(view, LayerViews) and len(view.layers) == stack.shape[0]
                np.testing.assert_array_equal(view.layers[-1], stack[-1])
        else:
            assert all(a is b for a, b in zip(jax.tree.leaves(group), leaves, strict=True))


def test_the_layer_loop_on_views_gives_the_stacks_logits_and_gradients(tiny):
    ctx, model_def, params, router, (tokens, positions, segments) = tiny

    def loss(p):
        logits, _ = model_lib.apply(model_def, p, router, tokens, positions, segments)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    with jax.set_mesh(ctx.mesh):
        ref, ref_grads = jax.jit(jax.value_and_grad(loss))(params)
        # The loop reads the views; the VJP of `unstacked` stacks their gradients again.
        out, grads = jax.jit(jax.value_and_grad(lambda p: loss(model_lib.unstacked(p))))(params)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_scanned_layer_loop_refuses_split_parameters(tiny):
    _, model_def, params, router, (tokens, positions, segments) = tiny
    scanned = make_config({"model_name": "tagtrain-tiny", "scan_layers": "true"})
    ctx = ShardCtx(
        make_mesh(validate(scanned, 1), "explicit"), logical_rules(scanned.parallelism), "explicit"
    )
    scanned_def = model_lib.define(scanned.model, ctx)
    with jax.set_mesh(ctx.mesh), pytest.raises(ValueError, match="set scan_layers=false"):
        model_lib.apply(
            scanned_def, model_lib.unstacked(params), router, tokens, positions, segments
        )
