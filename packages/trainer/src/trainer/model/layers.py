"""Small building blocks: RMSNorm, SwiGLU MLP (rotary embeddings: rope.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import pspec_tags as pt
from trainer.model import lora
from trainer.model.params import param
from trainer.sharding import ShardCtx

BSE = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class MLPNames:
    """Logical axis names of the SwiGLU MLP, weights and activations."""

    wi: tuple = ("embed", "mlp")
    wo: tuple = ("mlp", "embed")
    hidden: tuple = ("activation_batch", "activation_length", "activation_mlp")
    out: tuple = BSE


MLP_NAMES = MLPNames()
NORM_SCALE = ("norm",)
# Names (jax.ad_checkpoint.checkpoint_name) of the values remat_policy=selective
# recomputes in the backward instead of saving: the norms' outputs (from the saved
# residual stream, one kernel each) and the dense SwiGLU's silu(h0) * h1.
NORM_OUT, SWIGLU_OUT = "norm_out", "swiglu_out"
RECOMPUTED = (NORM_OUT, SWIGLU_OUT)


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale: the input's dtype in and out, f32
    inside (rms_norm)."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, logical=NORM_SCALE):
        # Used in f32 (normed * scale), never cast: see params.CAST_AT_USE.
        self.scale = param(rngs, (dim,), logical, init="ones", cast_at_use=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return checkpoint_name(rms_norm(x, self.scale[...], self.eps), NORM_OUT)


def _normed(x, scale_D, eps):
    """(x * rsqrt(mean(x^2) + eps) * scale in f32, the per-row rsqrt)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = x32 * inv
    # `normed * scale` would raise ShardingTypeError when the scale is reduced
    # over 'data' and `normed` is sharded over it; broadcast_param gives the
    # scale the activation's sharding and keeps its gradient unreduced.
    return normed * pt.broadcast_param(scale_D, normed), inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dim: reads x in its dtype, writes the result in it, and
    accumulates the mean square in f32. Its backward (a custom VJP) saves x and one
    f32 rsqrt per row, not autodiff's f32 copies of x, and computes dx in one pass:
    dx = r (g s) - x r^3 mean(g s x), with r the row's rsqrt; the scale's gradient
    (g x r, summed over rows) goes through broadcast_param's transpose, so a reduced
    scale's cotangent stays unreduced as before."""
    return _normed(x, scale_D, eps)[0].astype(x.dtype)


def _rms_norm_fwd(x, scale_D, eps):
    y, inv = _normed(x, scale_D, eps)
    return y.astype(x.dtype), (x, scale_D, inv)


def _rms_norm_bwd(eps, residuals, g):
    del eps  # in `inv` already
    x, scale_D, inv = residuals
    g32, x32 = g.astype(jnp.float32), x.astype(jnp.float32)
    broadcast = functools.partial(pt.broadcast_param, like=g32)
    gs = g32 * broadcast(scale_D)
    dx = inv * gs - x32 * (inv**3) * jnp.mean(gs * x32, axis=-1, keepdims=True)
    # The scale's cotangent through the transpose of its broadcast (sum over rows).
    _, pull = jax.vjp(broadcast, scale_D)
    (d_scale,) = pull(g32 * x32 * inv)
    return dx.astype(x.dtype), d_scale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class MLP(nnx.Module):
    """SwiGLU feed-forward: (silu(x W0) * x W1) Wo; `lora`: adapters on the weights
    it targets (mlp_wi_0, mlp_wi_1, mlp_wo)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        ctx: ShardCtx,
        dtype,
        *,
        rngs: nnx.Rngs,
        lora_spec: lora.LoraSpec | None = None,
    ):
        self.wi_0 = param(rngs, (dim, hidden), MLP_NAMES.wi)
        self.wi_1 = param(rngs, (dim, hidden), MLP_NAMES.wi)
        self.wo = param(rngs, (hidden, dim), MLP_NAMES.wo)
        for attr, logical in (("wi_0", MLP_NAMES.wi), ("wi_1", MLP_NAMES.wi), ("wo", MLP_NAMES.wo)):
            lora.attach(self, attr, f"mlp_{attr}", lora_spec, rngs, logical=logical)
        self.ctx, self.dtype = ctx, dtype

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        hidden = MLP_NAMES.hidden
        # Casting a (possibly reduced) weight is fine: it meets no activation. The
        # cast comes first so an FSDP gather (ctx.weight) moves compute-dtype bytes.
        h0 = self._project("bsd,df->bsf", x_BxSxD, "wi_0", MLP_NAMES.wi, hidden)
        h1 = self._project("bsd,df->bsf", x_BxSxD, "wi_1", MLP_NAMES.wi, hidden)
        act = checkpoint_name(jax.nn.silu(h0) * h1, SWIGLU_OUT)
        return self._project("bsf,fd->bsd", act, "wo", MLP_NAMES.wo, MLP_NAMES.out)

    def _project(self, equation, x, attr, logical, out):
        return lora.project(self.ctx, equation, x, self, attr, logical, out=out, dtype=self.dtype)
