"""The trainer's MoE feed-forward: NNX parameters around moe_kernels' functional layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import moe_kernels
from trainer.config import Config
from trainer.model.params import LOGICAL, param
from trainer.sharding import ShardCtx


class RouterBias(nnx.Variable):
    """DeepSeek's aux-loss-free routing bias: moved by load statistics, never by gradients."""


def moe_config(config: Config) -> moe_kernels.MoEConfig:
    """The moe_kernels view of the trainer config."""
    return moe_kernels.MoEConfig(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        mlp_dim=config.base_moe_mlp_dim,
        n_groups=config.n_routing_groups,
        topk_groups=config.topk_routing_group,
        routed_scaling_factor=config.routed_scaling_factor,
        score_func=config.routed_score_func,
        num_shared_experts=config.shared_experts,
        capacity_factor=config.capacity_factor or None,
        precision=None,
    )


class MoE(nnx.Module):
    """Routed experts (sparse ragged_dot or dense reference) plus shared experts."""

    def __init__(self, config: Config, ctx: ShardCtx, *, rngs: nnx.Rngs):
        self.moe = moe_config(config)
        shapes = moe_kernels.param_shapes(self.moe, config.emb_dim)
        axes = dict(self.moe.param_axes)
        for name, shape in shapes.items():
            if name == "bias":
                zeros = jnp.zeros(shape, jnp.float32)
                self.bias = RouterBias(zeros, **{LOGICAL: tuple(axes[name])})
            else:
                setattr(self, name, param(rngs, shape, axes[name], fan_in=shape[-2]))
        self.names = tuple(shapes)
        self.ctx, self.sparse = ctx, config.sparse_matmul
        self.remat_policy = config.remat_policy
        self.dtype = jnp.dtype(config.dtype)

    def __call__(self, x_BxSxD: jax.Array) -> tuple[jax.Array, dict]:
        params = {}
        for name in self.names:
            value = getattr(self, name)[...]
            # The bias only selects experts; it must not receive a gradient.
            params[name] = (
                jax.lax.stop_gradient(value) if name == "bias" else value.astype(self.dtype)
            )
        layer = moe_kernels.sparse_moe if self.sparse else moe_kernels.dense_moe
        ctx = self.ctx
        if ctx.manual:
            # Already per device inside the caller's shard_map: moe_kernels' own
            # shard_map cannot nest there, and there is nothing left to shard.
            return layer(x_BxSxD, params, config=self.moe)
        return layer(
            x_BxSxD,
            params,
            config=self.moe,
            mesh=ctx.mesh,
            rules=ctx.rules,
            mode=ctx.mode,
            # A rematerialized layer saves no residuals of its own: the MoE
            # checkpoint would only add memory there (0.36 GiB on 671b / v5p).
            recompute_casts=self.remat_policy == "none",
        )
