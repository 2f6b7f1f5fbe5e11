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

Both return the output rows in assignment order and the number of assignments
dropped (int32 scalar): the share that number is of all assignments is what a
run reports per layer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from moe_kernels.config import MoEConfig
from moe_kernels.grouped import swiglu_by_expert, swiglu_grouped
from pspec_tags import to_varying


def inverse(perm: jax.Array) -> jax.Array:
    """The inverse permutation of `perm`."""
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

    One stable argsort by expert; an assignment's rank is its position in the
    sorted order minus where its expert's run starts.
    """
    order_A = jnp.argsort(ids_A, stable=True)
    sorted_A = ids_A[order_A]
    counts_E = jnp.bincount(ids_A, length=num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted_A = jnp.arange(ids_A.shape[0]) - starts_E[sorted_A]
    return (rank_sorted_A < capacity)[inverse(order_A)]


def routed_local(x_TxD, ids_A, k, kernels, e_start, e_local, grouped, vary_axis=None, keep_A=None):
    """Run the assignments whose expert lives on this shard; others give zero rows.

    `keep_A` (from `within_capacity` over all experts, the same on every expert
    shard): assignments outside it are dropped (zero rows); the count returned is
    of all experts' drops, not only this shard's.
    """
    if vary_axis is not None:
        # The row gather below has indices that differ per expert shard. JAX
        # 0.10.2 transposes a gather wrongly when the operand is invariant over a
        # mesh axis and the indices vary over it (the cotangent comes back
        # garbled, not just unsummed); a varying operand gives the right
        # transpose: a scatter-add followed by a psum over `vary_axis`.
        x_TxD = to_varying(x_TxD, vary_axis)
    local_A = ids_A - e_start
    mine_A = (local_A >= 0) & (local_A < e_local)
    dropped = jnp.zeros((), jnp.int32)
    if keep_A is not None:
        mine_A = mine_A & keep_A
        dropped = jnp.sum(~keep_A).astype(jnp.int32)
    # Foreign (and dropped) assignments sort last under key e_local and fall past
    # sum(sizes): the grouped matmul gives them zero rows.
    key_A = jnp.where(mine_A, local_A, e_local)
    if grouped["impl"] == "padded_blocks":
        # Slots by rank within the expert: no sort, no inverse permutation.
        out_AxD = swiglu_by_expert(x_TxD, key_A, k, *kernels, precision=grouped["precision"])
        return out_AxD, dropped
    order_A = jnp.argsort(key_A, stable=True)
    sizes_E = jnp.bincount(key_A, length=e_local).astype(jnp.int32)
    rows_AxD = x_TxD[order_A // k]
    out_AxD = swiglu_grouped(rows_AxD, *kernels, sizes_E, **grouped)
    return out_AxD[inverse(order_A)], dropped


def routed_all_to_all(x_TxD, ids_A, k, kernels, ep, axis, e_local, capacity, grouped):
    """Expert parallelism: dispatch rows to their expert's shard and bring them back.

    Padded all-to-all over mesh axis `axis` (size `ep`): block (source,
    destination) holds `capacity` rows; with capacity = T*Z (the default) nothing
    can overflow. Returns the output rows in assignment order and the number of
    assignments dropped on overflow.
    """
    n_assign, d = ids_A.shape[0], x_TxD.shape[-1]
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
    # Received blocks are grouped by source; regroup by local expert (padding,
    # id e_local, sorts last and past sum(sizes), so it computes to zero).
    order_I = jnp.argsort(recv_ids_I, stable=True)
    sizes_E = jnp.bincount(recv_ids_I, length=e_local).astype(jnp.int32)
    out_IxD = swiglu_grouped(recv_WxYxD.reshape(-1, d)[order_I], *kernels, sizes_E, **grouped)
    back_WxYxD = lax.all_to_all(
        out_IxD[inverse(order_I)].reshape(ep, capacity, d), axis, 0, 0, tiled=True
    )
    out_sorted_AxD = back_WxYxD.at[dest_A, slot_A].get(mode="fill", fill_value=0)
    return out_sorted_AxD[inverse(order_A)], dropped


def router_z_BxS(logits_BxSxE: jax.Array) -> jax.Array:
    """Each token's router z: logsumexp(logits)^2 (ST-MoE's z-loss term, in f32).

    The z-loss is their mean times a coefficient; it keeps router logits small
    (Zoph et al. 2022, "ST-MoE"; Megatron's moe_z_loss_coeff, MaxText's z-loss).
    """
    return jnp.square(jax.nn.logsumexp(logits_BxSxE.astype(jnp.float32), axis=-1))
