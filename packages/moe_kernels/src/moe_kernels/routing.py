"""Token-to-expert routing: DeepSeek-V3 (sigmoid, bias, group-limited), DeepSeek-V2
(softmax, group-limited greedy) and plain top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_kernels.config import MoEConfig


def _group_mask(select_xE: jax.Array, config: MoEConfig) -> jax.Array:
    """Boolean (..., E): experts that belong to one of the `topk_groups` best groups.

    A group scores the sum of its two best selection scores (noaux_tc,
    DeepSeek-V3; one when a group holds a single expert) or its best one
    (group_limited_greedy, DeepSeek-V2).
    """
    g, per = config.n_groups, config.experts_per_group
    grouped = select_xE.reshape(*select_xE.shape[:-1], g, per)  # (..., G, E/G)
    if config.topk_method == "group_limited_greedy":
        group_score_xG = grouped.max(-1)
    else:
        best, _ = lax.top_k(grouped, min(2, per))
        group_score_xG = best.sum(-1)
    _, top_groups_xJ = lax.top_k(group_score_xG, config.topk_groups)
    keep_xG = jax.nn.one_hot(top_groups_xJ, g, dtype=jnp.int32).sum(-2) > 0
    return jnp.repeat(keep_xG, per, axis=-1)


def route(
    logits: jax.Array, *, config: MoEConfig, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Pick `num_experts_per_tok` experts per token and their combine weights.

    `logits` is (..., E): router logits for each token; leading dims are batch
    dims and the one before E (if any) is the sequence, which only the
    sequence-wise balance loss looks at. Returns `(weights_xZ, expert_ids_xZ,
    stats)`:

    - scores are `sigmoid(logits)` or `softmax(logits)`;
    - `bias` (E,), the aux-loss-free balancing bias, is added for the choice of
      experts only: combine weights are read from the unbiased scores;
    - with `n_groups > 1`, only experts in the `topk_groups` best groups are
      eligible, a group scored by `topk_method` (see `_group_mask`; 'greedy'
      has no groups);
    - weights are renormalized to sum to one when `norm_topk_prob`, then scaled
      by `routed_scaling_factor`.

    `stats["tokens_per_expert"]` (E,) int32 counts the assignments in this call
    (this shard's tokens, when called inside a shard_map);
    `stats["balance_loss"]` is DeepSeek-V3's sequence-wise balance loss
    `sum_i f_i P_i` (unscaled; 1.0 at perfect balance), averaged over sequences.

    Call it on unsharded or per-shard (shard_map) arrays, or under auto
    sharding; `sparse_moe`/`dense_moe` call it inside their shard_map.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from moe_kernels import MoEConfig, route
    >>> show = lambda a: print(np.array2string(np.asarray(a), precision=3))
    >>> config = MoEConfig(num_experts=4, num_experts_per_tok=2)  # hashable: a static argument
    >>> route_jit = jax.jit(route, static_argnames="config")
    >>> logits_TxE = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    >>> weights_TxZ, ids_TxZ, stats = route_jit(logits_TxE, config=config)
    >>> ids_TxZ.tolist(), stats["tokens_per_expert"].tolist()
    ([[0, 1], [2, 3]], [1, 1, 1, 1])
    >>> show(weights_TxZ)  # sigmoid scores of the picks, renormalized
    [[0.546 0.454]
     [0.566 0.434]]

    A bias steers the choice; the weights stay the unbiased scores':

    >>> bias_E = jnp.array([0, 0, 0, 5.0])
    >>> weights_TxZ, ids_TxZ, _ = route_jit(logits_TxE, config=config, bias=bias_E)
    >>> ids_TxZ.tolist()
    [[3, 0], [3, 2]]
    >>> show(weights_TxZ)
    [[0.234 0.766]
     [0.434 0.566]]
    """
    e, k = config.num_experts, config.num_experts_per_tok
    if logits.ndim < 1 or logits.shape[-1] != e:
        raise ValueError(f"router logits of shape {logits.shape} must end in num_experts={e}")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"routing bias of shape {bias.shape} must be (num_experts={e},)")
    logits = logits.astype(jnp.float32)
    if config.score_func == "sigmoid":
        scores_xE = jax.nn.sigmoid(logits)
    else:
        scores_xE = jax.nn.softmax(logits, axis=-1)
    select_xE = scores_xE
    if bias is not None:
        # The bias steers selection only and is trained by load statistics, not
        # by gradients: stop_gradient keeps it out of autodiff entirely.
        select_xE = select_xE + lax.stop_gradient(bias.astype(jnp.float32))
    if config.n_groups > 1 and config.topk_groups < config.n_groups:
        select_xE = jnp.where(_group_mask(select_xE, config), select_xE, -jnp.inf)
    _, ids_xZ = lax.top_k(select_xE, k)
    weights_xZ = jnp.take_along_axis(scores_xE, ids_xZ, axis=-1)
    if config.norm_topk_prob:
        weights_xZ = weights_xZ / (weights_xZ.sum(-1, keepdims=True) + 1e-20)
    weights_xZ = weights_xZ * config.routed_scaling_factor

    counts_E = jnp.bincount(ids_xZ.reshape(-1), length=e).astype(jnp.int32)
    stats = {
        "tokens_per_expert": counts_E,
        "balance_loss": _sequence_balance_loss(scores_xE, ids_xZ, config),
    }
    return weights_xZ, ids_xZ, stats


def _sequence_balance_loss(scores_xE: jax.Array, ids_xZ: jax.Array, config: MoEConfig):
    """DeepSeek-V3 sequence-wise balance loss, `mean_seq sum_i f_i P_i`.

    f_i = E / (K S) * (assignments to expert i in the sequence), P_i = mean over
    the sequence of the scores normalized over all experts.
    """
    e, k = config.num_experts, config.num_experts_per_tok
    if scores_xE.ndim == 1:
        scores_xE, ids_xZ = scores_xE[None], ids_xZ[None]
    s = scores_xE.shape[-2]
    scores_BxSxE = scores_xE.reshape(-1, s, e)
    ids_BxA = ids_xZ.reshape(scores_BxSxE.shape[0], s * k)
    n = scores_BxSxE.shape[0]
    # Per-sequence counts with one bincount over (sequence, expert) pairs.
    flat = (jnp.arange(n, dtype=jnp.int32)[:, None] * e + ids_BxA).reshape(-1)
    counts_BxE = jnp.bincount(flat, length=n * e).reshape(n, e)
    f_BxE = counts_BxE.astype(jnp.float32) * (e / (k * s))
    normalized = scores_BxSxE / (scores_BxSxE.sum(-1, keepdims=True) + 1e-20)
    p_BxE = normalized.mean(axis=1)
    return (f_BxE * p_BxE).sum(-1).mean()


def update_routing_bias(
    bias_E: jax.Array, tokens_per_expert_E: jax.Array, *, rate: float
) -> jax.Array:
    """DeepSeek-V3 aux-loss-free balancing: raise the bias of underloaded experts.

    `b_i += rate * sign(mean_load - load_i)`; call once per optimizer step with
    the step's total `tokens_per_expert` (the `stats` of `sparse_moe`/`dense_moe`).

    >>> import jax.numpy as jnp
    >>> from moe_kernels import update_routing_bias
    >>> print(update_routing_bias(jnp.zeros(4), jnp.array([3, 1, 0, 0]), rate=0.01))
    [-0.01  0.    0.01  0.01]
    """
    load = tokens_per_expert_E.astype(jnp.float32)
    step = rate * jnp.sign(load.mean() - load)
    return (bias_E.astype(jnp.float32) + step).astype(bias_E.dtype)
