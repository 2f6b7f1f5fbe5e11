"""Which attention kernel a model runs: the `attention` key, "auto" decided here.

Three kernels compute the same causal, per-document softmax attention:

- dot_product: XLA's einsums and softmax over materialized (B, H, S, U) f32 scores
  (every platform; the most activation memory);
- cudnn_flash: cuDNN's fused attention (through JAX's cuDNN call). It needs a GPU this
  process can reach (a compile-only GPU topology on a CPU host has no cuDNN to ask),
  bf16 or f16 compute, head dims of at most 128, and the whole sequence on each
  device (the kernel's causal mask counts positions from 0 on every shard, so
  context parallelism is out);
- splash: Pallas's TPU flash kernel (model/splash_attention.py). It needs TPU
  devices (a compile-only TPU topology compiles it: Mosaic runs in libtpu), a
  sequence that is a multiple of its 128-row tiles, and the whole sequence on each
  device (its causal mask also counts from 0 per shard), outside the pipeline's
  stages (splash_attention.py says why). Asked for by name on CPU devices it runs in
  Pallas's interpreter (how the CPU tests check it).

"auto" takes the first of cudnn_flash, splash that can run, else dot_product.
"""

from __future__ import annotations

import jax

import pspec_tags as pt
from trainer.config import ConfigError, ModelConfig
from trainer.model import splash_attention
from trainer.sharding import ShardCtx

CUDNN_MAX_HEAD_DIM = 128
# Splash's kv tiles are computed 128 lanes at a time (its block_kv_compute must be a
# multiple of 128 on a TPU), so the sequence must split into its smallest tile.
SPLASH_TILE = min(splash_attention.TILES)
# auto's preference order among the fused kernels.
FUSED = ("cudnn_flash", "splash")


def _platforms(ctx: ShardCtx) -> set[str]:
    # An AbstractMesh (plan-reduction's) has no devices: its `.devices` raises
    # ValueError, which getattr's default does not catch.
    abstract = isinstance(ctx.mesh, jax.sharding.AbstractMesh)
    devices = None if abstract else ctx.mesh.devices
    return {d.platform for d in (devices.flat if devices is not None else jax.devices())}


def _sequence_sharded(ctx: ShardCtx) -> bool:
    # Manual mode too: inside the pipeline's stages each device holds its sequence
    # chunk, and a fused kernel's causal mask by index would ignore the chunk's offset.
    return bool(pt.mesh_axes_used(ctx.spec(("activation_length",))))


def cudnn_flash_blockers(config: ModelConfig, ctx: ShardCtx) -> list[str]:
    """Why cudnn_flash cannot run this model on this mesh (empty: it can)."""
    blockers = []
    platforms = _platforms(ctx)
    if platforms != {"gpu"}:
        blockers.append(f"the mesh's devices are {sorted(platforms)}, not GPUs")
    elif jax.default_backend() != "gpu":
        blockers.append("the GPUs are a compile-only topology (no cuDNN on this host)")
    if config.dtype not in ("bfloat16", "float16"):
        blockers.append(f"dtype={config.dtype} (cuDNN attention runs bf16/f16)")
    head = max(config.qk_head_dim, config.v_head_dim)
    if head > CUDNN_MAX_HEAD_DIM:
        blockers.append(f"head dim {head} > {CUDNN_MAX_HEAD_DIM}")
    if _sequence_sharded(ctx):
        blockers.append("the sequence is sharded (context parallelism)")
    return blockers


def splash_blockers(
    config: ModelConfig, ctx: ShardCtx, seq_len: int | None = None, *, interpreted: bool = False
) -> list[str]:
    """Why splash cannot run this model on this mesh (empty: it can). `seq_len`:
    the sequence the layer sees (None: not known yet, not checked); `interpreted`:
    CPU devices are accepted (Pallas's interpreter, attention=splash by name)."""
    del config  # splash takes every dtype and head dim the model has
    blockers = []
    platforms = _platforms(ctx)
    if platforms != {"tpu"} and not (interpreted and platforms == {"cpu"}):
        blockers.append(f"the mesh's devices are {sorted(platforms)}, not TPUs")
    if seq_len is not None and seq_len % SPLASH_TILE:
        blockers.append(f"max_target_length={seq_len} is not a multiple of {SPLASH_TILE}")
    if _sequence_sharded(ctx):
        blockers.append("the sequence is sharded (context parallelism)")
    if ctx.manual:
        # Splash runs in an unchecked shard_map (splash_attention.py); the pipeline's
        # manual map keeps JAX's varying-axes checks, which carry the gradients' tags.
        blockers.append("per-device code (the pipeline's stages)")
    return blockers


def _blockers(kernel: str, config: ModelConfig, ctx: ShardCtx, seq_len, interpreted):
    if kernel == "cudnn_flash":
        return cudnn_flash_blockers(config, ctx)
    return splash_blockers(config, ctx, seq_len, interpreted=interpreted)


def choose_kernel(config: ModelConfig, ctx: ShardCtx, seq_len: int | None = None) -> str:
    """ "dot_product", "cudnn_flash" or "splash" for `config.attention` on this mesh
    (and, when given, this sequence length); ConfigError when a fused kernel is
    asked for by name where it cannot run, naming the key and the reason."""
    if config.attention == "dot_product":
        return "dot_product"
    if config.attention in FUSED:
        blockers = _blockers(config.attention, config, ctx, seq_len, interpreted=True)
        if blockers:
            raise ConfigError(
                f"attention={config.attention} cannot run here: {'; '.join(blockers)}"
            )
        return config.attention
    for kernel in FUSED:
        if not _blockers(kernel, config, ctx, seq_len, interpreted=False):
            return kernel
    return "dot_product"


def splash_interpreted(ctx: ShardCtx) -> bool:
    """Whether splash runs in Pallas's interpreter here (a CPU mesh), not as Mosaic."""
    return _platforms(ctx) == {"cpu"}


def describe(config: ModelConfig, ctx: ShardCtx, seq_len: int) -> str:
    """The startup line: the kernel a run's attention compiles to, and why not a
    fused one where it is dot_product."""
    chosen = choose_kernel(config, ctx, seq_len)
    if chosen == "cudnn_flash":
        return f"attention: cudnn_flash ({cudnn_plan(config, ctx).describe()})"
    if chosen == "splash":
        where = "interpreted: CPU devices" if splash_interpreted(ctx) else "Pallas on TPU"
        return f"attention: splash ({where}, causal with document segments)"
    why = [
        f"not {k}: {'; '.join(_blockers(k, config, ctx, seq_len, interpreted=False))}"
        for k in FUSED
    ]
    reason = "asked for" if config.attention == "dot_product" else "; ".join(why)
    return f"attention: dot_product ({reason})"


def cudnn_plan(config: ModelConfig, ctx: ShardCtx):
    """How the cuDNN call runs on this mesh's GPUs (cudnn_attention.plan): packed
    documents or a mask, v at its own head dim or padded, and why."""
    from trainer.model import cudnn_attention  # function-local: it imports jax's internals

    devices = list(ctx.mesh.devices.flat)
    return cudnn_attention.plan(devices, config.v_head_dim, config.qk_head_dim)
