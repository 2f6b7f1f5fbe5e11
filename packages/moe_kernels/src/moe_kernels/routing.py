"""Token-to-expert routing: DeepSeek-V3 (sigmoid, bias, group-limited), DeepSeek-V2
(softmax, group-limited greedy) and plain top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_kernels.config import MoEConfig

# Up to this many picks from up to RANK_N entries, `top_k` ranks every entry in one
# reduction instead of calling lax.top_k.
SMALL_K = 8
# The ranking compares every pair of entries (N^2 per row, inside one fusion): cheap
# for a router's 16-64 experts or a handful of groups, not for hundreds.
RANK_N = 64


def top_k(x_xN: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, int32 indices) of the k largest along the last axis, largest first,
    ties to the lower index: what `lax.top_k` returns.

    For k <= SMALL_K and N <= RANK_N, each entry's rank (how many entries beat it:
    larger, or equal at a lower index) is one reduction over the pairs, and the
    picks are read off the ranks 0..k-1 by a second, with their values in the same
    kernel. On a GPU lax.top_k is a sort (three per MoE layer for grouped routing);
    k rounds of a max and an argmax launched about four small kernels per round
    (issue 53: the deviceless H200 estimate). Ranks are distinct, so an entry is
    picked once, even when everything left is -inf.
    """
    n = x_xN.shape[-1]
    if k > SMALL_K or n > RANK_N:
        return lax.top_k(x_xN, k)
    iota_N = jnp.arange(n, dtype=jnp.int32)
    x_i, x_j = x_xN[..., :, None], x_xN[..., None, :]
    lower_NxN = iota_N[None, :] < iota_N[:, None]  # [i, j]: j comes before i
    beats_xNxN = (x_j > x_i) | ((x_j == x_i) & lower_NxN)
    rank_xN = jnp.sum(beats_xNxN, axis=-1, dtype=jnp.int32)
    pick_xKxN = rank_xN[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]
    indices = jnp.sum(jnp.where(pick_xKxN, iota_N, 0), axis=-1, dtype=jnp.int32)
    # Exactly one entry per pick: the sum is that entry's value (-inf included).
    values = jnp.sum(jnp.where(pick_xKxN, x_xN[..., None, :], 0), axis=-1)
    return values.astype(x_xN.dtype), indices


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
    # jnp.bincount: that is a scatter-add, a kernel of its own on a GPU. One count
    # per sequence serves the balance loss and, summed, the step's load statistics.
    if scores_xE.ndim == 1:
        scores_xE, ids_xZ = scores_xE[None], ids_xZ[None]
    s = scores_xE.shape[-2]
    counts_BxE = _one_hot_counts(ids_xZ.reshape(-1, s * k), e)
    stats = {
        "tokens_per_expert": counts_BxE.sum(0),
        "balance_loss": _sequence_balance_loss(scores_xE.reshape(-1, s, e), counts_BxE, config),
    }
    return weights_xZ, ids_xZ.reshape(*logits.shape[:-1], k), stats


def _sequence_balance_loss(scores_BxSxE: jax.Array, counts_BxE: jax.Array, config: MoEConfig):
    """DeepSeek-V3 sequence-wise balance loss, `mean_seq sum_i f_i P_i`.

    f_i = E / (K S) * (assignments to expert i in the sequence, `counts_BxE`), P_i
    = mean over the sequence of the scores normalized over all experts.
    """
    b, s, e = scores_BxSxE.shape
    k = config.num_experts_per_tok
    normalized = scores_BxSxE / (scores_BxSxE.sum(-1, keepdims=True) + 1e-20)
    # One reduction to the scalar: the means over S and B folded into the constant.
    f_BxE = counts_BxE.astype(jnp.float32) * (e / (k * s * s * b))
    return jnp.sum(f_BxE[:, None, :] * normalized)


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
