"""Tokens to their experts' rows and back by gathers whose gradients are gathers.

The routed experts read their rows from a slot layout: expert e's assignments sit
in slots `[start_e, start_e + size_e)` in assignment (token-major) order, each
expert's run padded to a multiple of `align` (1: contiguous, what a grouped GEMM
takes; M: whole blocks of M rows, what `padded_blocks` takes). `layout` computes,
without a sort and without a scatter:

- `dest_A`: the slot of each assignment (`num_slots`: none, a foreign or dropped
  assignment);
- `src_P`: the assignment in each slot (A: none, a padding slot), its inverse.

Moving rows is then a gather either way, and so is each gradient: the transpose of
a permutation is its inverse permutation (`dispatch`), and the combine of a token's
top-k rows is a gather plus a weighted sum whose gradient gathers the token's
cotangent into its slots (`combine`). Left to autodiff, a gather's transpose is a
scatter-add, which on a GPU is the slowest kernel class per byte
(benchmarks/results/device_check.md); here no scatter is left in the forward or the
backward pass. Names: A assignments (T tokens x K choices), P slots, E experts, D embed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pspec_tags import to_varying


def _vma(x) -> frozenset:
    """The mesh axes `x` varies over (empty outside a shard_map): JAX 0.10+ keeps
    them in the type's `manual_axis_type.varying`, earlier releases in `vma`."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(getattr(manual, "varying", None) or ())
    return frozenset(getattr(aval, "vma", None) or ())


def vary_like(x: jax.Array, *others: jax.Array) -> jax.Array:
    """`x` cast to vary over every mesh axis one of `others` varies over (inside a
    shard_map; a no-op outside), as an op mixing them would cast it. A custom_vjp
    gets its inputs so cast: the cast's transpose, not the custom rule, then reduces
    the gradient (psum, or unreduced for a value with a reduced tag)."""
    have = _vma(x)
    extra = tuple(sorted(set().union(*(_vma(o) for o in others)) - have))
    # TAG: the cast a mixed op inserts; a reduced value's gradient stays unreduced.
    return to_varying(x, extra) if extra else x


def count_at_or_below(ends_E: jax.Array, values: jax.Array) -> jax.Array:
    """For each value, how many of the (sorted) ends are <= it: searchsorted(side="right").

    A compare-and-sum, not jnp.searchsorted: that lowers to a while loop of small
    kernels on GPU."""
    return jnp.sum(ends_E[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


def ranks(key_A: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rank_A, sizes_E, running_AxE): each assignment's rank among its group's in
    assignment order (what a stable sort by group would give), each group's size,
    and the running count of each group's assignments (inclusive). A key of
    `num_groups` or more is in no group (rank -1). One cumsum, no sort, no scatter."""
    onehot_AxE = (key_A[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.int32)
    running_AxE = jnp.cumsum(onehot_AxE, axis=0)
    rank_A = jnp.sum(running_AxE * onehot_AxE, axis=1) - 1
    return rank_A, running_AxE[-1], running_AxE


def num_slots(num_assign: int, num_groups: int, align: int) -> int:
    """Slots of a layout padded to `align`: every assignment plus, per group, less
    than one `align` of padding (rounded to whole multiples of `align`)."""
    if align == 1:
        return num_assign
    return (-(-num_assign // align) + num_groups) * align


def layout(key_A: jax.Array, num_groups: int, align: int):
    """(dest_A, src_P, sizes_E, group_P): the slot layout of the module docstring.

    `group_P` is the group of each slot's padded run (num_groups past the last);
    `sizes_E` the unpadded sizes. The inverse `src_P` is found by a binary search of
    each slot's rank in its group's running count (log2(A) gathers from a small
    table that XLA fuses), not by a scatter of `dest_A`.
    """
    a = key_A.shape[0]
    p = num_slots(a, num_groups, align)
    rank_A, sizes_E, running_AxE = ranks(key_A, num_groups)
    padded_E = (sizes_E + align - 1) // align * align
    ends_E = jnp.cumsum(padded_E)
    starts_E = ends_E - padded_E
    in_group_A = key_A < num_groups
    g_A = jnp.minimum(key_A, num_groups - 1)
    dest_A = jnp.where(in_group_A, starts_E[g_A] + rank_A, p)

    slot_P = jnp.arange(p, dtype=jnp.int32)
    group_P = count_at_or_below(ends_E, slot_P)
    g_P = jnp.minimum(group_P, num_groups - 1)
    offset_P = slot_P - starts_E[g_P]
    filled_P = (group_P < num_groups) & (offset_P < sizes_E[g_P])
    # The assignment in slot (g, o) is the first a whose running count of g exceeds o.
    flat = running_AxE.reshape(-1)
    lo, hi = jnp.zeros_like(slot_P), jnp.full_like(slot_P, a)
    for _ in range(max(1, a.bit_length())):
        mid = jnp.minimum((lo + hi) // 2, a - 1)
        right = flat[mid * num_groups + g_P] <= offset_P
        lo, hi = jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)
    src_P = jnp.where(filled_P, lo, a)
    return dest_A, src_P, sizes_E, group_P


def _take_rows(x_NxD: jax.Array, index_M: jax.Array) -> jax.Array:
    """Rows `x[index]`, zero where the index is past the end (no such row)."""
    return x_NxD.at[index_M].get(mode="fill", fill_value=0)


def dispatch(x_TxD: jax.Array, src_P: jax.Array, dest_TxK: jax.Array) -> jax.Array:
    """Rows of the slot layout: slot p holds token src_P[p] // K (zero for no assignment).

    `dest_TxK` (the inverse, by token and choice) is what the gradient gathers by:
    a token's cotangent is the sum of its K slots' (zero where it has no slot)."""
    return _dispatch(vary_like(x_TxD, src_P, dest_TxK), src_P, dest_TxK)


@jax.custom_vjp
def _dispatch(x_TxD, src_P, dest_TxK):
    return _take_rows(x_TxD, src_P // dest_TxK.shape[1])


def _dispatch_fwd(x_TxD, src_P, dest_TxK):
    return _dispatch(x_TxD, src_P, dest_TxK), (src_P, dest_TxK)


def _dispatch_bwd(res, g_PxD):
    src_P, dest_TxK = res
    g_TxD = jnp.sum(_take_rows(g_PxD, dest_TxK), axis=1)
    return g_TxD, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine(out_PxD: jax.Array, w_TxK: jax.Array, src_P: jax.Array, dest_TxK: jax.Array):
    """Each token's weighted sum of its K slots' rows, in float32: y_t = sum_k w[t, k]
    x out[dest[t, k]] (a slot past the end contributes zero).

    Gradients: d out[p] = w[a] x dy[a // K] for the assignment a = src_P[p] (a gather;
    zero for a padding slot), d w[t, k] = <dy[t], out[dest[t, k]]>."""
    ints = (src_P, dest_TxK)
    return _combine(vary_like(out_PxD, w_TxK, *ints), vary_like(w_TxK, out_PxD, *ints), *ints)


@jax.custom_vjp
def _combine(out_PxD, w_TxK, src_P, dest_TxK):
    rows_TxKxD = _take_rows(out_PxD, dest_TxK).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", rows_TxKxD, w_TxK.astype(jnp.float32))


def _combine_fwd(out_PxD, w_TxK, src_P, dest_TxK):
    return _combine(out_PxD, w_TxK, src_P, dest_TxK), (out_PxD, w_TxK, src_P, dest_TxK)


def _combine_bwd(res, g_TxD):
    out_PxD, w_TxK, src_P, dest_TxK = res
    k = w_TxK.shape[1]
    w_A = w_TxK.reshape(-1).astype(jnp.float32)
    # Each slot's assignment weight and its token's cotangent, both by gather.
    w_P = w_A.at[src_P].get(mode="fill", fill_value=0)
    g_out_PxD = (_take_rows(g_TxD, src_P // k) * w_P[:, None]).astype(out_PxD.dtype)
    # The rows again (a gather, cheaper than keeping T x K x D for the backward).
    rows_TxKxD = _take_rows(out_PxD, dest_TxK).astype(jnp.float32)
    g_w_TxK = jnp.einsum("tkd,td->tk", rows_TxKxD, g_TxD.astype(jnp.float32))
    return g_out_PxD, g_w_TxK.astype(w_TxK.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)
