"""Routing properties: bias steers selection only, group limits, weights, stats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_kernels import MoEConfig, route, routing, update_routing_bias


def _logits(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def test_bias_changes_selection_but_not_combine_weights():
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0)
    logits = _logits((4, 16, 8))
    bias = jnp.zeros(8).at[3].set(5.0)  # expert 3 wins every token's first slot
    w0, ids0, _ = route(logits, config=cfg)
    w1, ids1, _ = route(logits, config=cfg, bias=bias)
    assert np.all(np.asarray(ids1) == 3, axis=-1).sum() == 0  # top-2 are distinct
    assert np.all(np.any(np.asarray(ids1) == 3, axis=-1))
    assert not np.array_equal(ids0, ids1)
    # Combine weights come from the unbiased scores of the chosen experts.
    scores = np.asarray(jax.nn.sigmoid(logits))
    picked = np.take_along_axis(scores, np.asarray(ids1), -1)
    np.testing.assert_allclose(w1, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    # Same choice -> same weights, whatever the bias.
    same = np.all(np.sort(ids0, -1) == np.sort(ids1, -1), axis=-1)
    assert same.any()
    np.testing.assert_allclose(
        np.sort(np.asarray(w0)[same], -1), np.sort(np.asarray(w1)[same], -1), rtol=1e-6
    )


def test_bias_gets_no_gradient():
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2)
    logits = _logits((32, 8))
    g = jax.grad(lambda b: route(logits, config=cfg, bias=b)[0].sum() ** 2)(jnp.ones(8))
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("n_groups,topk_groups,k", [(4, 1, 2), (4, 2, 3), (8, 3, 3), (2, 1, 4)])
def test_group_limiting_never_picks_outside_the_top_groups(n_groups, topk_groups, k):
    e = 16
    cfg = MoEConfig(
        num_experts=e, num_experts_per_tok=k, n_groups=n_groups, topk_groups=topk_groups
    )
    logits = _logits((256, e), seed=n_groups * 10 + topk_groups)
    bias = 0.3 * _logits((e,), seed=99)
    _, ids, _ = route(logits, config=cfg, bias=bias)
    select = np.asarray(jax.nn.sigmoid(logits) + bias)
    per = e // n_groups
    grouped = select.reshape(-1, n_groups, per)
    group_score = np.sort(grouped, -1)[..., -min(2, per) :].sum(-1)
    top_groups = np.argsort(-group_score, -1)[:, :topk_groups]
    chosen_groups = np.asarray(ids) // per
    for t in range(ids.shape[0]):
        assert set(chosen_groups[t]) <= set(top_groups[t]), t
    # And within the allowed groups the choice is the plain top-k.
    allowed = np.zeros_like(select, bool)
    for t in range(ids.shape[0]):
        for g in top_groups[t]:
            allowed[t, g * per : (g + 1) * per] = True
    masked = np.where(allowed, select, -np.inf)
    expect = np.argsort(-masked, -1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(expect, -1))


def test_without_groups_it_is_plain_top_k():
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=3)
    logits = _logits((64, 8))
    _, ids, _ = route(logits, config=cfg)
    expect = np.argsort(-np.asarray(logits), -1)[:, :3]
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(expect, -1))


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
def test_weights_normalized_and_scaled(score_func, norm):
    cfg = MoEConfig(
        num_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        score_func=score_func,
        norm_topk_prob=norm,
    )
    logits = _logits((4, 8, 8))
    w, ids, _ = route(logits, config=cfg)
    f = jax.nn.sigmoid if score_func == "sigmoid" else lambda v: jax.nn.softmax(v, -1)
    raw = np.take_along_axis(np.asarray(f(logits)), np.asarray(ids), -1)
    expect = raw / raw.sum(-1, keepdims=True) if norm else raw
    np.testing.assert_allclose(w, 2.5 * expect, rtol=1e-6)


def test_stats_counts_and_balance_loss():
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2)
    logits = _logits((3, 10, 4))
    _, ids, stats = route(logits, config=cfg)
    np.testing.assert_array_equal(
        stats["tokens_per_expert"], np.bincount(np.asarray(ids).ravel(), minlength=4)
    )
    assert int(stats["tokens_per_expert"].sum()) == 3 * 10 * 2
    # Uniform scores: P_i = 1/E and sum_i f_i = E, so the loss is exactly 1.
    _, _, s = route(jnp.zeros((2, 4, 4)), config=cfg)
    np.testing.assert_allclose(s["balance_loss"], 1.0, rtol=1e-6)
    # Every token on experts 0 and 1 costs more than tokens spread over all four.
    skewed = jnp.zeros((1, 4, 4)).at[..., 0].set(5.0).at[..., 1].set(4.0)
    spread = (jnp.eye(4) * 5.0 + jnp.roll(jnp.eye(4), 1, 1) * 4.0)[None]
    _, ids_spread, s_spread = route(spread, config=cfg)
    np.testing.assert_array_equal(s_spread["tokens_per_expert"], [2, 2, 2, 2])
    _, _, s_skew = route(skewed, config=cfg)
    assert float(s_skew["balance_loss"]) > 1.2 * float(s_spread["balance_loss"])


def test_update_routing_bias_moves_toward_balance():
    bias = jnp.zeros(4)
    load = jnp.array([10, 2, 5, 0])  # mean 4.25
    new = update_routing_bias(bias, load, rate=0.1)
    np.testing.assert_allclose(new, [-0.1, 0.1, -0.1, 0.1], rtol=1e-6)
    assert new.dtype == bias.dtype


def test_route_shape_errors():
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts=8"):
        route(jnp.zeros((4, 6)), config=cfg)
    with pytest.raises(ValueError, match=r"\(num_experts=8,\)"):
        route(jnp.zeros((4, 8)), config=cfg, bias=jnp.zeros(6))


@pytest.mark.parametrize("shape,k", [((6, 16), 2), ((3, 5, 4), 2), ((7, 32), 8), ((4, 9), 1)])
def test_top_k_ranks_match_lax_top_k_with_ties_and_inf(shape, k):
    # Few distinct values force ties (the lower index first) and rows of -inf
    # must still give k distinct picks, as lax.top_k does.
    rng = np.random.default_rng(k)
    x = rng.integers(-2, 2, size=shape).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = -np.inf
    x.reshape(-1)[shape[-1] + 1 : shape[-1] + 4] = -np.inf
    for values in (x, rng.normal(size=shape).astype(np.float32)):
        got = jax.jit(routing.top_k, static_argnums=1)(jnp.asarray(values), k)
        want = jax.lax.top_k(jnp.asarray(values), k)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_top_k_launches_no_sort_on_few_experts():
    # The ranking path is reductions only: no sort (lax.top_k's lowering) in its HLO.
    text = jax.jit(routing.top_k, static_argnums=1).lower(jnp.zeros((8, 16)), 2).as_text()
    assert "sort" not in text and "top_k" not in text.replace("jit_top_k", "")
    wide = jax.jit(routing.top_k, static_argnums=1).lower(jnp.zeros((8, 128)), 2).as_text()
    assert "top_k" in wide.replace("jit_top_k", "")
