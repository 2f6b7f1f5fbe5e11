"""Routed-expert dispatch inside one shard: which rows go to which expert, capacity, drops.

Called by the shard_map body (moe_kernels.shard_body). Two paths, picked by the
sharding plan (`moe_kernels.shard_plan`):

- `routed_local`: this shard runs its own experts on its own tokens (no expert
  parallelism, or expert shards that do not shard the tokens). A positive
  `capacity_factor` caps each expert at `local_capacity` rows of the shard's
  assignments, first come first served in assignment (token-major) order.
- `routed_all_to_all`: tokens sharded over the expert axis; rows travel to the
  shard owning their expert in a padded `all_to_all` whose (source, destination)
  blocks hold `block_capacity` rows each.

Both return each token's combined routed output (float32) and the number of
assignments dropped (int32 scalar): the share that number is of all assignments is
what a run reports per layer. The rows reach the experts by gathers whose
gradients are gathers (`experts_combined`, moe_kernels.permute): no scatter in the
forward or backward pass, except on the all-to-all path's send side.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from moe_kernels import permute
from moe_kernels.config import MoEConfig
from moe_kernels.grouped import align_for, swiglu_slots
from pspec_tags import to_varying


def inverse(perm: jax.Array) -> jax.Array:
    """The inverse permutation of `perm` (a scatter: only the all-to-all path's send
    side still uses it)."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def local_capacity(config: MoEConfig, n_assign: int) -> int | None:
    """Rows each expert may take of `n_assign` assignments on the local path:
    ceil(n_assign / E * capacity_factor) (MaxText's expert capacity), or None
    when `capacity_factor` is 0 (no token dropped, no cap computed at all)."""
    if not config.capacity_factor:
        return None
    return max(1, math.ceil(n_assign / config.num_experts * config.capacity_factor))


def block_capacity(config: MoEConfig, n_assign: int, ep: int) -> int:
    """Rows of each (source, destination) block of the padded all-to-all: every
    assignment (T*Z) when `capacity_factor` is 0, else ceil(T*Z/EP * capacity_factor)."""
    if not config.capacity_factor:  # 0: no token dropped
        return n_assign
    return max(1, min(n_assign, math.ceil(n_assign / ep * config.capacity_factor)))


def within_capacity(ids_A: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Boolean (A,): the assignment is among the first `capacity` of its expert's,
    counted in assignment order (token-major: earlier tokens keep their slot).

    An assignment's rank is the running count of its expert's assignments (one
    cumsum; no sort, no scatter).
    """
    rank_A, _, _ = permute.ranks(ids_A, num_experts)
    return rank_A < capacity


def experts_combined(x_TxD, key_A, weights_TxK, kernels, e_local, grouped):
    """Each token's weighted sum of its assignments' SwiGLU outputs, float32 (T, D).

    Assignment a is token a // K for local expert key_A[a] (e_local or more: none, it
    adds zero). Rows reach their experts' slot layout and come back by gathers whose
    gradients are gathers (moe_kernels.permute); the experts run as `grouped` says
    (moe_kernels.grouped: impl, precision, sms).
    """
    t, k = weights_TxK.shape
    impl = grouped["impl"]
    align = align_for(impl, key_A.shape[0], e_local)
    dest_A, src_P, sizes_E, group_P = permute.layout(key_A, e_local, align)
    dest_TxK = dest_A.reshape(t, k)
    rows_PxD = permute.dispatch(x_TxD, src_P, dest_TxK)
    out_PxD = swiglu_slots(rows_PxD, kernels, sizes_E, group_P, align=align, **grouped)
    return permute.combine(out_PxD, weights_TxK, src_P, dest_TxK)


def routed_local(
    x_TxD, ids_A, weights_TxK, kernels, e_start, e_local, grouped, vary_axis=None, keep_A=None
):
    """Run the assignments whose expert lives on this shard; others add zero.

    Returns each token's combined routed output (float32) and the drops. `keep_A`
    (from `within_capacity` over all experts, the same on every expert shard):
    assignments outside it are dropped; the count returned is of all experts'
    drops, not only this shard's.
    """
    if vary_axis is not None:
        # The rows' indices differ per expert shard while the tokens do not: the
        # tokens vary over `vary_axis` first, so their gradient is summed over it
        # by this cast's transpose (a psum), once.
        x_TxD = to_varying(x_TxD, vary_axis)
    local_A = ids_A - e_start
    mine_A = (local_A >= 0) & (local_A < e_local)
    dropped = jnp.zeros((), jnp.int32)
    if keep_A is not None:
        mine_A = mine_A & keep_A
        dropped = jnp.sum(~keep_A).astype(jnp.int32)
    # Foreign (and dropped) assignments get key e_local: no slot, zero output.
    key_A = jnp.where(mine_A, local_A, e_local)
    return experts_combined(x_TxD, key_A, weights_TxK, kernels, e_local, grouped), dropped


def routed_all_to_all(x_TxD, ids_A, weights_TxK, kernels, ep, axis, e_local, capacity, grouped):
    """Expert parallelism: dispatch rows to their expert's shard and bring them back.

    Padded all-to-all over mesh axis `axis` (size `ep`): block (source,
    destination) holds `capacity` rows; with capacity = T*Z (the default) nothing
    can overflow. Returns each token's combined routed output (float32) and the
    number of assignments dropped on overflow. The send side sorts and scatters;
    the receiving shard reaches its experts by gathers (`experts_combined`).
    """
    n_assign, d = ids_A.shape[0], x_TxD.shape[-1]
    k = weights_TxK.shape[1]
    order_A = jnp.argsort(ids_A, stable=True)
    sorted_ids_A = ids_A[order_A]
    dest_A = sorted_ids_A // e_local
    per_dest = jnp.bincount(dest_A, length=ep)
    starts = jnp.cumsum(per_dest) - per_dest
    slot_A = jnp.arange(n_assign) - starts[dest_A]
    dropped = jnp.sum(slot_A >= capacity).astype(jnp.int32)
    # mode="drop" discards rows past the capacity of their block.
    send_WxYxD = (
        jnp.zeros((ep, capacity, d), x_TxD.dtype)
        .at[dest_A, slot_A]
        .set(x_TxD[order_A // k], mode="drop")
    )
    send_ids_WxY = (
        jnp.full((ep, capacity), e_local, jnp.int32)
        .at[dest_A, slot_A]
        .set(sorted_ids_A % e_local, mode="drop")
    )
    recv_WxYxD = lax.all_to_all(send_WxYxD, axis, 0, 0, tiled=True)
    recv_ids_I = lax.all_to_all(send_ids_WxY, axis, 0, 0, tiled=True).reshape(-1)
    # Each received row is its own "token" with one choice of weight 1; padding
    # (id e_local) gets no slot and comes back zero.
    recv_IxD = recv_WxYxD.reshape(-1, d)
    ones_Ix1 = jnp.ones((recv_IxD.shape[0], 1), jnp.float32)
    out_IxD = experts_combined(recv_IxD, recv_ids_I, ones_Ix1, kernels, e_local, grouped)
    back_WxYxD = lax.all_to_all(
        out_IxD.astype(x_TxD.dtype).reshape(ep, capacity, d), axis, 0, 0, tiled=True
    )
    out_sorted_AxD = back_WxYxD.at[dest_A, slot_A].get(mode="fill", fill_value=0)
    out_AxD = out_sorted_AxD[inverse(order_A)]
    routed_TxD = jnp.einsum(
        "tkd,tk->td", out_AxD.reshape(-1, k, d).astype(jnp.float32), weights_TxK
    )
    return routed_TxD, dropped


def router_z_BxS(logits_BxSxE: jax.Array) -> jax.Array:
    """Each token's router z: logsumexp(logits)^2 (ST-MoE's z-loss term, in f32).

    The z-loss is their mean times a coefficient; it keeps router logits small
    (Zoph et al. 2022, "ST-MoE"; Megatron's moe_z_loss_coeff, MaxText's z-loss).
    """
    return jnp.square(jax.nn.logsumexp(logits_BxSxE.astype(jnp.float32), axis=-1))
