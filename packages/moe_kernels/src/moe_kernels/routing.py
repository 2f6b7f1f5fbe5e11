"""Token-to-expert routing: DeepSeek-V3 (sigmoid, bias, group-limited), DeepSeek-V2
(softmax, group-limited greedy) and plain top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_kernels.config import MoEConfig

# Up to this many picks, `top_k` takes k rounds of reductions instead of lax.top_k.
SMALL_K = 8


def top_k(x_xN: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, int32 indices) of the k largest along the last axis, largest first,
    ties to the lower index: what `lax.top_k` returns.

    For k <= SMALL_K, k rounds of a max and an argmax over what is not yet taken:
    reductions that XLA fuses with the routing around them, where lax.top_k is a
    sort on a GPU (three sorts per MoE layer for grouped routing). An entry that is
    taken never wins again, even when everything left is -inf.
    """
    if k > SMALL_K:
        return lax.top_k(x_xN, k)
    n = x_xN.shape[-1]
    iota_N = jnp.arange(n, dtype=jnp.int32)
    taken_xN = jnp.zeros(x_xN.shape, bool)
    values, indices = [], []
    for _ in range(k):
        best_x = jnp.max(jnp.where(taken_xN, -jnp.inf, x_xN), axis=-1)
        # The first entry not yet taken that holds the best value.
        hit_xN = ~taken_xN & (x_xN == best_x[..., None])
        index_x = jnp.argmax(hit_xN, axis=-1).astype(jnp.int32)
        taken_xN = taken_xN | (iota_N == index_x[..., None])
        values.append(best_x)
        indices.append(index_x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


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
        best, _ = top_k(grouped, min(2, per))
        group_score_xG = best.sum(-1)
    _, top_groups_xJ = top_k(group_score_xG, config.topk_groups)
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
    _, ids_xZ = top_k(select_xE, k)
    weights_xZ = _chosen(scores_xE, ids_xZ)
    if config.norm_topk_prob:
        weights_xZ = weights_xZ / (weights_xZ.sum(-1, keepdims=True) + 1e-20)
    weights_xZ = weights_xZ * config.routed_scaling_factor

    # Counts as sums of a one-hot (a reduction XLA fuses with its neighbours), not
    # jnp.bincount: that is a scatter-add, a kernel of its own on a GPU.
    counts_E = _one_hot_counts(ids_xZ.reshape(1, -1), e)[0]
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
    counts_BxE = _one_hot_counts(ids_BxA, e)
    f_BxE = counts_BxE.astype(jnp.float32) * (e / (k * s))
    normalized = scores_BxSxE / (scores_BxSxE.sum(-1, keepdims=True) + 1e-20)
    p_BxE = normalized.mean(axis=1)
    return (f_BxE * p_BxE).sum(-1).mean()


@jax.custom_vjp
def _chosen(scores_xE: jax.Array, ids_xZ: jax.Array) -> jax.Array:
    """The chosen experts' scores: a gather forward. Its gradient is a one-hot
    select-and-sum over the K picks, not take_along_axis's transpose (a scatter-add,
    a kernel of its own on a GPU). A select-and-sum in the forward as well made
    XLA:TPU's peak of live buffers exceed its reported total (tests/test_aot.py)."""
    return jnp.take_along_axis(scores_xE, ids_xZ, axis=-1)


def _chosen_fwd(scores_xE, ids_xZ):
    return _chosen(scores_xE, ids_xZ), (scores_xE, ids_xZ)


def _chosen_bwd(res, g_xZ):
    scores_xE, ids_xZ = res
    chosen_xZxE = ids_xZ[..., None] == jnp.arange(scores_xE.shape[-1], dtype=ids_xZ.dtype)
    g_xE = jnp.sum(jnp.where(chosen_xZxE, g_xZ[..., None], 0.0), axis=-2)
    return g_xE.astype(scores_xE.dtype), None


_chosen.defvjp(_chosen_fwd, _chosen_bwd)


def _one_hot_counts(ids_BxA: jax.Array, num_experts: int) -> jax.Array:
    """(B, E) int32: how many of each row's ids equal each expert."""
    onehot_BxAxE = ids_BxA[..., None] == jnp.arange(num_experts, dtype=ids_BxA.dtype)
    return jnp.sum(onehot_BxAxE, axis=1, dtype=jnp.int32)


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
