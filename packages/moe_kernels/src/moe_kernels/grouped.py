"""Grouped SwiGLU over rows sorted by expert: two implementations, one contract.

`swiglu_grouped(rows_AxD, wi0_ExDxF, wi1_ExDxF, wo_ExFxD, sizes_E, impl=...)` runs
rows `[start_e, start_e + sizes_E[e])` through expert e's SwiGLU; rows past
`sum(sizes_E)` come out zero. Shapes: A rows, D embed, E experts, F expert hidden,
N blocks, M rows per block.

- `ragged_dot`: `jax.lax.ragged_dot`, three grouped matmuls. XLA:TPU runs them as
  grouped matmuls. XLA:GPU (through JAX 0.11) rewrites each into a dense matmul
  over every expert (rows times E x D), E times the FLOPs and bytes of the
  routed experts (benchmarks/results/gpu_probe.json, "ops"; the step with each:
  benchmarks/results/device_check.md).
- `padded_blocks`: each expert's rows padded to a multiple of M and cut into
  blocks of M rows that belong to one expert; the SwiGLU is three batched
  matmuls over the blocks, each block against its expert's weights (gathered per
  block). Padding costs at most E x (M - 1) rows of FLOPs, the weight gathers
  N x D x F per kernel; no matmul runs over foreign experts.

`IMPLS` names them; `auto` picks padded_blocks on GPU and ragged_dot elsewhere
(`resolve`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("auto", "ragged_dot", "padded_blocks")


def resolve(impl: str, platform: str) -> str:
    """The implementation `impl` stands for on `platform` ("gpu", "tpu", "cpu")."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul={impl!r} is not one of {IMPLS}")
    if impl != "auto":
        return impl
    return "padded_blocks" if platform in ("gpu", "cuda", "rocm") else "ragged_dot"


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block M: half a group's mean share, a power of two in [64, 512].

    Larger blocks make larger matmuls and fewer weight gathers; smaller ones pad
    less (at most num_groups x (M - 1) rows). On one H200 at 16,384 rows over 16
    experts, 512 ran fastest of 128/256/512 (benchmarks/results/gpu_probe.json, "ops").
    """
    half_share = max(1, num_rows // (2 * num_groups))
    m = 1 << (half_share.bit_length() - 1)  # the power of two at or below
    return min(512, max(64, m))


def swiglu_grouped(rows_AxD, wi0_ExDxF, wi1_ExDxF, wo_ExFxD, sizes_E, *, impl, precision=None):
    """SwiGLU of each row with its group's expert weights; see the module docstring."""
    if impl == "ragged_dot":
        h0 = lax.ragged_dot(rows_AxD, wi0_ExDxF, sizes_E, precision=precision)
        h1 = lax.ragged_dot(rows_AxD, wi1_ExDxF, sizes_E, precision=precision)
        return lax.ragged_dot(jax.nn.silu(h0) * h1, wo_ExFxD, sizes_E, precision=precision)
    if impl == "padded_blocks":
        return _swiglu_blocks(rows_AxD, wi0_ExDxF, wi1_ExDxF, wo_ExFxD, sizes_E, precision)
    raise ValueError(f"impl={impl!r} is not one of {IMPLS[1:]}")


def _padded_swiglu(rows_AxD, group_A, offset_A, sizes_E, kernels, precision):
    """The SwiGLU of row a through expert group_A[a] (E: no expert, zero out), placed
    at offset_A[a] among that expert's rows in a layout padded to blocks of M rows.

    Rows go in with one scatter and come out with one gather. A row of no expert
    gets its own index past the layout (N*M + a): dropped on the way in, zero on
    the way out, and every index distinct, as unique_indices promises.
    """
    a, d = rows_AxD.shape
    e = sizes_E.shape[0]
    m = block_rows(a, e)
    num_blocks = -(-a // m) + e  # each group pads by less than one block
    padded_E = (sizes_E + m - 1) // m * m
    padded_ends_E = jnp.cumsum(padded_E)
    g_A = jnp.minimum(group_A, e - 1)
    dest_A = jnp.where(
        group_A < e, padded_ends_E[g_A] - padded_E[g_A] + offset_A, num_blocks * m + jnp.arange(a)
    )
    # Blocks past the last group's padding hold only zero rows: any expert will do.
    block_start_N = jnp.arange(num_blocks) * m
    expert_N = jnp.minimum(_count_at_or_below(padded_ends_E, block_start_N), e - 1)
    padded_NxMxD = (
        jnp.zeros((num_blocks * m, d), rows_AxD.dtype)
        .at[dest_A]
        .set(rows_AxD, mode="drop", unique_indices=True)
        .reshape(num_blocks, m, d)
    )
    out_NxMxD = _blocks_swiglu(padded_NxMxD, *kernels, expert_N, precision)
    return (
        out_NxMxD.reshape(num_blocks * m, d)
        .at[dest_A]
        .get(mode="fill", fill_value=0, unique_indices=True)
    )


def swiglu_by_expert(x_TxD, key_A, k, wi0_ExDxF, wi1_ExDxF, wo_ExFxD, *, precision=None):
    """Each assignment's SwiGLU through its expert, by padded blocks, without sorting.

    Assignment a is token a // k sent to expert key_A[a]; key_A == E marks an
    assignment for no local expert (zero out). Each assignment's slot in the padded
    layout is its expert's padded start plus its rank among that expert's
    assignments in token order (what a stable sort by expert would give), so no
    argsort and no inverse permutation (on GPU, sorts, gathers and scatters were a
    large share of the step's kernel time: benchmarks/results/device_check.md).
    Returns out_AxD in assignment order.
    """
    e = wi0_ExDxF.shape[0]
    onehot_AxE = (key_A[:, None] == jnp.arange(e)[None, :]).astype(jnp.int32)
    sizes_E = jnp.sum(onehot_AxE, axis=0)
    # Rank within the expert: the running count of that expert's assignments.
    rank_A = jnp.sum(jnp.cumsum(onehot_AxE, axis=0) * onehot_AxE, axis=1) - 1
    rows_AxD = jnp.repeat(x_TxD, k, axis=0)  # assignment a reads token a // k
    kernels = (wi0_ExDxF, wi1_ExDxF, wo_ExFxD)
    return _padded_swiglu(rows_AxD, key_A, rank_A, sizes_E, kernels, precision)


def _blocks_swiglu(padded_NxMxD, wi0_ExDxF, wi1_ExDxF, wo_ExFxD, expert_N, precision):
    """The SwiGLU of each block of rows with its expert's weights."""
    h0_NxMxF = jnp.einsum(
        "nmd,ndf->nmf", padded_NxMxD, _per_block(wi0_ExDxF, expert_N), precision=precision
    )
    h1_NxMxF = jnp.einsum(
        "nmd,ndf->nmf", padded_NxMxD, _per_block(wi1_ExDxF, expert_N), precision=precision
    )
    return jnp.einsum(
        "nmf,nfd->nmd",
        jax.nn.silu(h0_NxMxF) * h1_NxMxF,
        _per_block(wo_ExFxD, expert_N),
        precision=precision,
    )


def _per_block(w_ExIxJ, expert_N):
    """Each block's expert weights, w[expert_N], as a matmul with the block-to-expert
    one-hot: exact (one nonzero term per sum), and its transpose sums the blocks'
    weight gradients into their experts as a matmul too, not a scatter-add of N
    weight-sized slices. Plain einsums, so sharding tags and varying types flow as
    through the layer's other matmuls."""
    onehot_NxE = jax.nn.one_hot(expert_N, w_ExIxJ.shape[0], dtype=w_ExIxJ.dtype)
    return jnp.einsum("ne,eij->nij", onehot_NxE, w_ExIxJ)


def _count_at_or_below(ends_E: jax.Array, values: jax.Array) -> jax.Array:
    """For each value, how many of the (sorted) ends are <= it: searchsorted(side="right")."""
    return jnp.sum(ends_E[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


def _swiglu_blocks(rows_AxD, wi0_ExDxF, wi1_ExDxF, wo_ExFxD, sizes_E, precision):
    """Rows already sorted by expert: a row's group is the number of group ends at or
    before it (E past the last group), its offset its distance from the group's start."""
    ends_E = jnp.cumsum(sizes_E)
    row_A = jnp.arange(rows_AxD.shape[0])
    # A compare-and-sum, not jnp.searchsorted: that lowers to a while loop of small
    # kernels on GPU.
    group_A = _count_at_or_below(ends_E, row_A)
    g_A = jnp.minimum(group_A, sizes_E.shape[0] - 1)
    offset_A = row_A - (ends_E[g_A] - sizes_E[g_A])
    kernels = (wi0_ExDxF, wi1_ExDxF, wo_ExFxD)
    return _padded_swiglu(rows_AxD, group_A, offset_A, sizes_E, kernels, precision)
