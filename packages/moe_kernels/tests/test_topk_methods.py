"""`topk_method` (noaux_tc, group_limited_greedy, greedy) against a numpy reference
written from DeepSeek's description of each, plus norm_topk_prob and the scaling."""

import numpy as np
import pytest

from moe_kernels import MoEConfig, route

E, K = 16, 3


def _reference(logits, bias, *, method, score_func, n_groups, topk_groups, norm, scale):
    """Per token, in plain numpy loops: the chosen experts (as a set) and their weights."""
    if score_func == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(-1, keepdims=True))
        scores = shifted / shifted.sum(-1, keepdims=True)
    choices, weights = [], []
    per = E // n_groups
    for token_scores in scores:
        select = token_scores + bias
        allowed = np.arange(E)
        if method != "greedy" and topk_groups < n_groups:
            group_scores = []
            for g in range(n_groups):
                members = np.sort(select[g * per : (g + 1) * per])[::-1]
                group_scores.append(members[:2].sum() if method == "noaux_tc" else members[0])
            best_groups = np.argsort(group_scores)[::-1][:topk_groups]
            allowed = np.concatenate([np.arange(g * per, (g + 1) * per) for g in best_groups])
        chosen = allowed[np.argsort(select[allowed])[::-1][:K]]
        w = token_scores[chosen]
        if norm:
            w = w / w.sum()
        choices.append(chosen)
        weights.append(dict(zip(chosen.tolist(), (w * scale).tolist(), strict=True)))
    return choices, weights


CASES = [
    # (method, score_func, n_groups, topk_groups, norm_topk_prob, routed_scaling_factor)
    ("noaux_tc", "sigmoid", 4, 2, True, 2.5),
    ("group_limited_greedy", "softmax", 4, 2, False, 1.0),
    ("group_limited_greedy", "softmax", 8, 3, True, 16.0),
    ("greedy", "softmax", 1, 1, False, 1.0),
    ("greedy", "sigmoid", 1, 1, True, 2.5),
]


@pytest.mark.parametrize("method,score_func,n_groups,topk_groups,norm,scale", CASES)
def test_topk_methods_match_the_reference(method, score_func, n_groups, topk_groups, norm, scale):
    cfg = MoEConfig(
        num_experts=E,
        num_experts_per_tok=K,
        n_groups=n_groups,
        topk_groups=topk_groups,
        topk_method=method,
        score_func=score_func,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    rng = np.random.default_rng(
        CASES.index((method, score_func, n_groups, topk_groups, norm, scale))
    )
    logits = rng.standard_normal((64, E)).astype(np.float32)
    # V2's methods run without a bias in DeepSeek's models; a bias still only steers.
    bias = (0.2 * rng.standard_normal(E)).astype(np.float32)
    weights, ids, _ = route(logits, config=cfg, bias=bias)
    want_ids, want_weights = _reference(
        logits,
        bias,
        method=method,
        score_func=score_func,
        n_groups=n_groups,
        topk_groups=topk_groups,
        norm=norm,
        scale=scale,
    )
    for t in range(logits.shape[0]):
        assert set(np.asarray(ids[t]).tolist()) == set(want_ids[t].tolist()), t
        got = dict(zip(np.asarray(ids[t]).tolist(), np.asarray(weights[t]).tolist(), strict=True))
        for expert, value in want_weights[t].items():
            np.testing.assert_allclose(got[expert], value, rtol=1e-5)


def test_group_scoring_differs_between_v2_and_v3():
    # Group 0 holds one strong expert, group 1 two good ones: V2 (best expert)
    # picks group 0, V3 (sum of the two best) picks group 1.
    logits = np.full((1, 8), -4.0, np.float32)
    logits[0, 0] = 3.0
    logits[0, 4:6] = 2.0
    picked = {}
    for method in ("group_limited_greedy", "noaux_tc"):
        cfg = MoEConfig(
            num_experts=8, num_experts_per_tok=1, n_groups=2, topk_groups=1, topk_method=method
        )
        picked[method] = int(route(logits, config=cfg)[1][0, 0])
    assert picked == {"group_limited_greedy": 0, "noaux_tc": 4}


def test_bad_topk_method_and_greedy_with_groups_are_refused():
    with pytest.raises(ValueError, match="topk_method='top2' is not one of"):
        MoEConfig(topk_method="top2")
    with pytest.raises(ValueError, match="topk_method='greedy' picks over all experts"):
        MoEConfig(num_experts=8, n_groups=2, topk_method="greedy")
