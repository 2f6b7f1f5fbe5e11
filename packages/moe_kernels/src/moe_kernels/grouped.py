"""The routed experts' SwiGLU over rows in a slot layout: three implementations, one contract.

`swiglu_slots(rows_PxD, kernels, sizes_E, group_P, impl=..., align=...)` runs the rows
of each expert's run in the slot layout of moe_kernels.permute (expert e's rows
contiguous, runs padded to a multiple of `align`, zero rows where no assignment is)
through that expert's SwiGLU; a zero row gives a zero row. Shapes: P slots, D embed,
E experts, F expert hidden, N blocks, M rows per block.

- `ragged_dot`: `jax.lax.ragged_dot`, three grouped matmuls (align 1). XLA:TPU runs
  them as grouped matmuls. XLA:GPU (through JAX 0.11) rewrites each into a dense
  matmul over every expert (rows times E x D), E times the FLOPs and bytes of the
  routed experts (benchmarks/results/gpu_probe.json, "ops"; the step with each:
  benchmarks/results/device_check.md).
- `padded_blocks`: each expert's run padded to a multiple of M and cut into blocks of
  M rows that belong to one expert; the SwiGLU is three batched matmuls over the
  blocks, each block against its expert's weights (a gather per block, whose gradient
  sums the blocks into their experts as one matmul). Padding costs at most E x (M - 1)
  rows of FLOPs, the weight gathers N x D x F per kernel; no matmul runs over foreign
  experts. Any XLA backend compiles it.
- `grouped_gemm`: JAX's Pallas Mosaic-GPU grouped GEMM for Hopper (sm_90), forward and
  both gradients (moe_kernels.gemm_mgpu; align 1: at most one tile of padding per
  expert, inside the kernel, and no weight copies).

`IMPLS` names them; `auto` picks grouped_gemm on an sm_90 GPU where it can be built,
padded_blocks on other GPUs, ragged_dot elsewhere (`choose`, which also says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moe_kernels import gemm_mgpu
from moe_kernels.activation import gated_silu
from moe_kernels.permute import vary_like

IMPLS = ("auto", "ragged_dot", "padded_blocks", "grouped_gemm")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def choose(impl: str, device, dtype, dims: tuple[int, int]) -> tuple[str, str]:
    """(implementation, why) that `impl` stands for on `device` for `dtype` weights of
    (embed, expert hidden) `dims`. `device` is a jax Device (its platform and, on a
    GPU, its compute capability) or a platform name."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul={impl!r} is not one of {IMPLS}")
    platform = device if isinstance(device, str) else device.platform
    if impl == "grouped_gemm":
        blockers = gemm_mgpu.blockers(device, dtype, dims)
        if blockers:
            raise ValueError(f"grouped_matmul=grouped_gemm cannot run here: {'; '.join(blockers)}")
        return impl, "asked for"
    if impl != "auto":
        return impl, "asked for"
    if platform not in GPU_PLATFORMS:
        return "ragged_dot", f"auto on {platform}"
    blockers = gemm_mgpu.blockers(device, dtype, dims)
    if not blockers:
        return "grouped_gemm", "auto on a Hopper GPU"
    return "padded_blocks", "auto on a GPU; not grouped_gemm: " + "; ".join(blockers)


def resolve(impl: str, platform: str) -> str:
    """The implementation `impl` stands for on `platform` for bf16 weights whose dims
    every kernel takes (see `choose`)."""
    return choose(impl, platform, jnp.bfloat16, (1024, 1024))[0]


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block M: half a group's mean share, a power of two in [64, 512].

    Larger blocks make larger matmuls and fewer weight gathers; smaller ones pad
    less (at most num_groups x (M - 1) rows). On one H200 at 16,384 rows over 16
    experts, 512 ran fastest of 128/256/512 (benchmarks/results/gpu_probe.json, "ops").
    """
    half_share = max(1, num_rows // (2 * num_groups))
    m = 1 << (half_share.bit_length() - 1)  # the power of two at or below
    return min(512, max(64, m))


def align_for(impl: str, num_rows: int, num_groups: int) -> int:
    """The slot layout's alignment `impl` needs: M rows for padded_blocks, else 1."""
    return block_rows(num_rows, num_groups) if impl == "padded_blocks" else 1


def swiglu_slots(rows_PxD, kernels, sizes_E, group_P, *, impl, align, precision=None, sms=132):
    """SwiGLU of each slot's row with its group's expert weights; see the module
    docstring. `sms`: the GPU's SM count, for grouped_gemm's weight-gradient kernel."""
    wi0_ExDxF, wi1_ExDxF, wo_ExFxD = kernels
    if impl == "ragged_dot":
        h0 = lax.ragged_dot(rows_PxD, wi0_ExDxF, sizes_E, precision=precision)
        h1 = lax.ragged_dot(rows_PxD, wi1_ExDxF, sizes_E, precision=precision)
        return lax.ragged_dot(gated_silu(h0, h1), wo_ExFxD, sizes_E, precision=precision)
    if impl == "grouped_gemm":
        # One varying type for rows and weights, as a matmul of them would cast to.
        kernels = tuple(vary_like(w, rows_PxD, sizes_E) for w in kernels)
        rows_PxD = vary_like(rows_PxD, *kernels)
        return gemm_mgpu.swiglu(rows_PxD, kernels, sizes_E, sms)
    if impl == "padded_blocks":
        p, d = rows_PxD.shape
        # Blocks past the last group's padding hold only zero rows: any expert will do.
        expert_N = jnp.minimum(group_P[::align], wi0_ExDxF.shape[0] - 1)
        out_NxMxD = _blocks_swiglu(
            rows_PxD.reshape(p // align, align, d), kernels, expert_N, precision
        )
        return out_NxMxD.reshape(p, d)
    raise ValueError(f"impl={impl!r} is not one of {IMPLS[1:]}")


def _blocks_swiglu(padded_NxMxD, kernels, expert_N, precision):
    """The SwiGLU of each block of rows with its expert's weights."""
    wi0, wi1, wo = (_per_block(w, expert_N) for w in kernels)
    h0_NxMxF = jnp.einsum("nmd,ndf->nmf", padded_NxMxD, wi0, precision=precision)
    h1_NxMxF = jnp.einsum("nmd,ndf->nmf", padded_NxMxD, wi1, precision=precision)
    return jnp.einsum("nmf,nfd->nmd", gated_silu(h0_NxMxF, h1_NxMxF), wo, precision=precision)


def _per_block(w_ExIxJ, expert_N):
    """Each block's expert weights, w[expert_N]: a gather (a copy, where a one-hot
    product read all E experts per block), whose gradient sums the blocks' weight
    gradients into their experts as a matmul with the block-to-expert one-hot, not a
    scatter-add of N weight-sized slices.

    The weights are first cast to vary like the block indices (over the token axes
    inside a shard_map), as a matmul with them would: the cast's transpose is what
    reduces the gradient (psum, or unreduced for a weight with a reduced tag)."""
    w_ExIxJ = vary_like(w_ExIxJ, expert_N)
    return _take_experts(w_ExIxJ, expert_N, w_ExIxJ.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_experts(w_ExIxJ, expert_N, num_experts):
    del num_experts
    return jnp.take(w_ExIxJ, expert_N, axis=0, mode="clip")


def _take_experts_fwd(w_ExIxJ, expert_N, num_experts):
    return _take_experts(w_ExIxJ, expert_N, num_experts), expert_N


def _take_experts_bwd(num_experts, expert_N, g_NxIxJ):
    onehot_NxE = jax.nn.one_hot(expert_N, num_experts, dtype=g_NxIxJ.dtype)
    return jnp.einsum("ne,nij->eij", onehot_NxE, g_NxIxJ), None


_take_experts.defvjp(_take_experts_fwd, _take_experts_bwd)
