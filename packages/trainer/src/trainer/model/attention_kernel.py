"""Which attention kernel a model runs: the `attention` key, "auto" decided once.

cuDNN's fused attention (through `jax.nn.dot_product_attention`) needs a GPU
this process can reach (a compile-only GPU topology on a CPU host has no cuDNN
to ask), bf16 or f16 compute, head dims of at most 128, and the whole sequence
on each device (the kernel's causal mask counts positions from 0 on every
shard, so context parallelism is out).
"""

from __future__ import annotations

import jax

import pspec_tags as pt
from trainer.config import ConfigError, ModelConfig
from trainer.sharding import ShardCtx

CUDNN_MAX_HEAD_DIM = 128


def cudnn_flash_blockers(config: ModelConfig, ctx: ShardCtx) -> list[str]:
    """Why cudnn_flash cannot run this model on this mesh (empty: it can)."""
    blockers = []
    # An AbstractMesh (plan-reduction's) has no devices: its `.devices` raises
    # ValueError, which getattr's default does not catch.
    abstract = isinstance(ctx.mesh, jax.sharding.AbstractMesh)
    devices = None if abstract else ctx.mesh.devices
    platforms = {d.platform for d in (devices.flat if devices is not None else jax.devices())}
    if platforms != {"gpu"}:
        blockers.append(f"the mesh's devices are {sorted(platforms)}, not GPUs")
    elif jax.default_backend() != "gpu":
        blockers.append("the GPUs are a compile-only topology (no cuDNN on this host)")
    if config.dtype not in ("bfloat16", "float16"):
        blockers.append(f"dtype={config.dtype} (cuDNN attention runs bf16/f16)")
    head = max(config.qk_head_dim, config.v_head_dim)
    if head > CUDNN_MAX_HEAD_DIM:
        blockers.append(f"head dim {head} > {CUDNN_MAX_HEAD_DIM}")
    if not ctx.manual and pt.mesh_axes_used(ctx.spec(("activation_length",))):
        blockers.append("the sequence is sharded (context parallelism)")
    return blockers


def cudnn_plan(config: ModelConfig, ctx: ShardCtx):
    """How the cuDNN call runs on this mesh's GPUs (cudnn_attention.plan): packed
    documents or a mask, v at its own head dim or padded, and why."""
    from trainer.model import cudnn_attention  # function-local: it imports jax's internals

    devices = list(ctx.mesh.devices.flat)
    return cudnn_attention.plan(devices, config.v_head_dim, config.qk_head_dim)


def choose_kernel(config: ModelConfig, ctx: ShardCtx) -> str:
    """ "dot_product" or "cudnn_flash" for `config.attention`; ConfigError when
    cudnn_flash is asked for where it cannot run, naming the key and the reason."""
    if config.attention == "dot_product":
        return "dot_product"
    blockers = cudnn_flash_blockers(config, ctx)
    if config.attention == "cudnn_flash" and blockers:
        raise ConfigError(f"attention=cudnn_flash cannot run here: {'; '.join(blockers)}")
    return "dot_product" if blockers else "cudnn_flash"
