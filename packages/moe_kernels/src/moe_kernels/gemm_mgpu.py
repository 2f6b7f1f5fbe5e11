"""Grouped GEMM on Hopper GPUs: JAX's Pallas Mosaic-GPU ragged dot, with both gradients.

JAX ships two Hopper (sm_90, wgmma) kernels as examples under
`jax.experimental.pallas.ops.gpu`: `ragged_dot_mgpu.ragged_dot` (rows sorted by group
times each group's (K, N) matrix, or its transpose; a group's rows pad at most one
row tile inside the kernel) and `transposed_ragged_dot_mgpu.transposed_ragged_dot`
(the per-group products of two row-ragged matrices: a weight gradient). `gmm` is
y = x @ w[group] as a custom_vjp over them:

- forward: ragged_dot(x, w);
- dx = ragged_dot(dy, w, transpose_rhs=True) (no transposed copy of w);
- dw = transposed_ragged_dot(x, dy), one (K, N) product per group.

Nothing is copied per expert and no FLOP runs over a foreign expert. The kernels
write only the rows of the groups, so the sizes given to them must add up to the
rows (`swiglu` folds trailing zero rows into the last group: zero rows give zero
outputs and add nothing to a weight gradient).

What this cannot show on a CPU host: the kernels run on an sm_90 GPU only; a
compile-only H100/H200 target (`train compile_topology=h100-1`) lowers them and
compiles the step around them (one custom call per kernel), but their PTX is built
when the program loads on a device. Their tiles are untuned here (TILE).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import jax
import jax.numpy as jnp

from moe_kernels.activation import gated_silu
from moe_kernels.permute import vary_like

# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n): 128 x 128 output
# tiles, 64-deep K steps, four in flight (~160 KiB of the 227 KiB of shared memory).
TILE = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}
TILE_T = {**TILE, "max_concurrent_steps": 2}
H100_SMS = 132  # H100 and H200 SXM: where a device does not say
_MODULES = ("ragged_dot_mgpu", "transposed_ragged_dot_mgpu")


def _kernels():
    """JAX's two kernel modules (ImportError where this jax lacks them or Mosaic GPU)."""
    base = "jax.experimental.pallas.ops.gpu."
    return tuple(importlib.import_module(base + name) for name in _MODULES)


def blockers(device, dtype, dims: tuple[int, int]) -> list[str]:
    """Why `gmm` cannot run the experts of `dims` (embed, hidden) in `dtype` on
    `device` (a jax Device or a platform name); empty when it can."""
    reasons = []
    platform = device if isinstance(device, str) else device.platform
    capability = getattr(device, "compute_capability", None)
    if platform != "gpu":
        reasons.append(f"not an NVIDIA GPU ({platform})")
    elif capability is None or not str(capability).startswith("9."):
        reasons.append(f"compute capability {capability}, the kernels are Hopper's (9.x)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        reasons.append(f"{jnp.dtype(dtype).name} weights (the kernels take bf16/f16)")
    tile = max(TILE["block_m"], TILE["block_n"])
    bad = [d for d in dims if d % tile]
    if bad:
        reasons.append(f"dims {bad} not multiples of the {tile}-wide tiles")
    if not reasons:
        try:
            _kernels()
        except ImportError as err:
            reasons.append(f"jax's Mosaic GPU kernels do not import ({err})")
    return reasons


class _JaxSeeing:
    """`jax` as transposed_ragged_dot reads it, with `devices()` answering `device`."""

    def __init__(self, device):
        self._device = device

    def __getattr__(self, name):
        return getattr(jax, name)

    def devices(self, *_, **__):
        return [self._device]


@contextlib.contextmanager
def _sm_count(sms: int):
    """transposed_ragged_dot sizes its grid by `jax.devices()[0].core_count` at trace
    time. On a GPU host that is the device's; compiling for a compile-only GPU from a
    CPU host it is a CPU device, which has none. While the kernel is traced, its
    module's `jax` answers a device with the target's SM count (nothing else is
    touched; restored after)."""
    if getattr(jax.devices()[0], "core_count", None) == sms:
        yield
        return
    module = _kernels()[1]
    device = type("TargetGpu", (), {"core_count": sms})()
    module.jax = _JaxSeeing(device)
    try:
        yield
    finally:
        module.jax = jax


# The kernels are called through jax.jit: every layer calls them on the same shapes,
# so jit traces each (kernel, shapes) once and the step's module holds one lowered
# function per kernel that each layer calls. Called directly, each of the 23 MoE layers
# of deepseek3-small lowered its own copy of each kernel's Mosaic GPU module (9 a layer
# and microbatch step: a large part of `train compile_topology=h200-1`'s Python time).
# XLA inlines the calls: the compiled program is the same.
@functools.partial(jax.jit, static_argnames=("transpose_rhs",))
def _ragged_dot(x_PxK, w_ExKxN, sizes_E, transpose_rhs=False):
    """JAX's ragged_dot kernel at TILE (w transposed per group with `transpose_rhs`)."""
    ragged = _kernels()[0]
    return ragged.ragged_dot(
        x_PxK, w_ExKxN, group_sizes=sizes_E, transpose_rhs=transpose_rhs, **TILE
    )


@functools.partial(jax.jit, static_argnames=("sms",))
def _transposed_ragged_dot(x_PxK, g_PxN, sizes_E, sms):
    """JAX's transposed_ragged_dot kernel at TILE_T, its grid sized for `sms` SMs
    (static: part of jit's cache key, so a trace for one target is not reused for
    another)."""
    with _sm_count(sms):
        return _kernels()[1].transposed_ragged_dot(x_PxK, g_PxN, group_sizes=sizes_E, **TILE_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(x_PxK, w_ExKxN, sizes_E, sms):
    """y[p] = x[p] @ w[group of p], rows sorted by group, sum(sizes_E) == P; `sms`: the
    target's SM count (static). See the module docstring."""
    del sms
    return vary_like(_ragged_dot(x_PxK, w_ExKxN, sizes_E), x_PxK, w_ExKxN)


def _gmm_fwd(x_PxK, w_ExKxN, sizes_E, sms):
    return gmm(x_PxK, w_ExKxN, sizes_E, sms), (x_PxK, w_ExKxN, sizes_E)


def _gmm_bwd(sms, res, g_PxN):
    x_PxK, w_ExKxN, sizes_E = res
    g_PxN = g_PxN.astype(x_PxK.dtype)
    dx = _ragged_dot(g_PxN, w_ExKxN, sizes_E, transpose_rhs=True)
    dw = _transposed_ragged_dot(x_PxK, g_PxN, sizes_E, sms)
    # Inside a shard_map a Pallas kernel's result is typed invariant whatever its
    # inputs; each gradient is typed as its primal (a no-op on values).
    return vary_like(dx, x_PxK), vary_like(dw.astype(w_ExKxN.dtype), w_ExKxN), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def swiglu(rows_PxD, kernels, sizes_E, sms: int = H100_SMS):
    """The experts' SwiGLU over rows sorted by expert (trailing rows zero) by `gmm`."""
    wi0, wi1, wo = kernels
    p, e = rows_PxD.shape[0], sizes_E.shape[0]
    # The kernels write only the groups' rows: the trailing (zero) rows join the last.
    sizes_E = sizes_E + jnp.where(jnp.arange(e) == e - 1, p - jnp.sum(sizes_E), 0)
    sizes_E = sizes_E.astype(jnp.int32)
    h0 = gmm(rows_PxD, wi0, sizes_E, sms)
    h1 = gmm(rows_PxD, wi1, sizes_E, sms)
    return gmm(gated_silu(h0, h1).astype(rows_PxD.dtype), wo, sizes_E, sms)
