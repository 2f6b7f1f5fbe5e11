"""The DeepSeek-style decoder: embeddings, dense then MoE blocks (scanned), logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import accum
import pspec_tags as pt
from trainer.config import ModelConfig
from trainer.model import lora, pipeline, pipeline_slots
from trainer.model.attention import MLA
from trainer.model.layers import BSE, MLP, RMSNorm
from trainer.model.moe_block import moe_layer
from trainer.model.mtp import MTPLayer, depth_targets
from trainer.model.params import param
from trainer.sharding import ShardCtx


@dataclasses.dataclass(frozen=True)
class DecoderNames:
    """Logical axis names of the embedding, the residual stream and the logits."""

    embedding: tuple = ("vocab", "embed")
    # The lookup gathers the vocab dim whole and lays the embed dim out like
    # the activations (see Decoder.__call__).
    embedding_lookup: tuple = (None, "activation_embed")
    logits_kernel: tuple = ("embed", "vocab")
    tokens: tuple = ("activation_batch", "activation_length")
    residual: tuple = BSE
    logits: tuple = ("activation_batch", "activation_length", "activation_vocab")


NAMES = DecoderNames()


class Block(nnx.Module):
    """Pre-norm attention then pre-norm feed-forward (dense MLP or MoE)."""

    def __init__(self, config: ModelConfig, ctx: ShardCtx, moe: bool, *, rngs: nnx.Rngs):
        eps = config.normalization_layer_epsilon
        self.attn_norm = RMSNorm(config.emb_dim, eps, rngs=rngs)
        self.attn = MLA(config, ctx, rngs=rngs)
        self.ffn_norm = RMSNorm(config.emb_dim, eps, rngs=rngs)
        dt = jnp.dtype(config.dtype)
        self.ffn = (
            moe_layer(config, ctx, rngs=rngs)
            if moe
            else MLP(
                config.emb_dim,
                config.base_mlp_dim,
                ctx,
                dt,
                rngs=rngs,
                lora_spec=lora.spec_of(config),
            )
        )
        self.is_moe, self.ctx = moe, ctx

    def __call__(self, x_BxSxD, positions_BxS, segments_BxS):
        x_BxSxD = x_BxSxD + self.attn(self.attn_norm(x_BxSxD), positions_BxS, segments_BxS)
        if self.is_moe:
            y_BxSxD, stats = self.ffn(self.ffn_norm(x_BxSxD))
        else:
            y_BxSxD, stats = self.ffn(self.ffn_norm(x_BxSxD)), {}
        return self.ctx.act(x_BxSxD + y_BxSxD, NAMES.residual), stats


def _stack(config: ModelConfig, ctx: ShardCtx, moe: bool, count: int, rngs: nnx.Rngs):
    """`count` blocks with parameters stacked on a leading layer axis (for lax.scan)."""
    return _stacked(lambda r: Block(config, ctx, moe, rngs=r), count, rngs)


def _stacked(make, count: int, rngs: nnx.Rngs):
    """`count` modules `make(rngs)` with parameters stacked on a leading layer axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make(rngs)

    return create(rngs)


def _mtp_stack(config: ModelConfig, ctx: ShardCtx, rngs: nnx.Rngs):
    """The MTP depths, stacked; each block dense or MoE as the main model's later layers."""
    moe = config.num_moe_layers > 0
    return _stacked(
        lambda r: MTPLayer(config, ctx, Block(config, ctx, moe, rngs=r), rngs=r),
        config.mtp_num_layers,
        rngs,
    )


REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # No layer checkpoint: the attention recomputes its (B, H, S, S) scores itself
    # (model/attention.py); everything else is saved as under `none`.
    "selective": None,
}


def _remat(body, config: ModelConfig):
    """`body` under the configured rematerialization policy (as the layer scan runs it)."""
    if REMAT[config.remat_policy] is None:
        return body
    return jax.checkpoint(body, policy=REMAT[config.remat_policy])


def _layer_slice(state, i: int):
    """Layer `i` of a stacked state (the leading axis dropped)."""
    return jax.tree.map(lambda leaf: jax.lax.index_in_dim(leaf, i, keepdims=False), state)


def _run_stack(stack: nnx.Module, x_BxSxD, positions_BxS, segments_BxS, config: ModelConfig):
    """The stacked blocks in order; returns the output and per-layer stats (stacked).

    `scan_layers` runs them as one lax.scan (compile time independent of depth);
    otherwise as an unrolled Python loop over layer slices (same numbers).
    """
    graphdef, state = nnx.split(stack)

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, positions_BxS, segments_BxS)

    body = _remat(body, config)
    # run.resolve decides scan_layers=auto (config/layer_loop.py); a model defined
    # outside a run (a test, a notebook) scans under auto, as on a TPU or CPU.
    if config.scan_layers is not False:
        # accum.scan_layers is lax.scan, except inside fused gradient accumulation:
        # there each layer's gradient is added into the accumulator in the backward scan.
        return accum.scan_layers(body, x_BxSxD, state)
    count = jax.tree.leaves(state)[0].shape[0]
    per_layer = []
    for i in range(count):
        x_BxSxD, stats = body(x_BxSxD, _layer_slice(state, i))
        per_layer.append(stats)
    return x_BxSxD, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


class Decoder(nnx.Module):
    """Token ids -> logits. Parameters in `weight_dtype`; compute runs in `config.dtype`."""

    def __init__(self, config: ModelConfig, ctx: ShardCtx, *, rngs: nnx.Rngs):
        d = config.emb_dim
        # Rows are cast after the lookup (f32 scatter-add in the backward), which
        # runs in a shard_map on the table's lookup copy (`embed`).
        self.embedding_VxD = param(
            rngs,
            (config.vocab_size, d),
            NAMES.embedding,
            fan_in=1,
            cast_at_use=False,
            summed_in_use=True,
        )
        if config.first_num_dense_layers:
            self.dense_layers = _stack(config, ctx, False, config.first_num_dense_layers, rngs)
        if config.num_moe_layers:
            # Uneven pipeline stages: the stack padded to equal chunks (model.init
            # draws the real layers' rows as without stages, zeros in the padding).
            layout = pipeline_slots.stack_slots(config, pipeline.stages(ctx), ctx.pipeline_repeats)
            count = layout.size if layout else config.num_moe_layers
            self.moe_layers = _stack(config, ctx, True, count, rngs)
        self.final_norm = RMSNorm(d, config.normalization_layer_epsilon, rngs=rngs)
        self.logits_DxV = param(rngs, (d, config.vocab_size), NAMES.logits_kernel)
        if config.mtp_num_layers:
            self.mtp = _mtp_stack(config, ctx, rngs)
        self.config, self.ctx = config, ctx

    def __call__(self, tokens_BxS, positions_BxS, segments_BxS):
        """Returns (logits_BxSxV in f32, MoE stats stacked over MoE layers)."""
        hidden_BxSxD, stats = self.hidden(tokens_BxS, positions_BxS, segments_BxS)
        return self.head(self.final_norm(hidden_BxSxD)), stats

    def embed(self, tokens_BxS):
        """Embedding rows of the token ids, in the compute dtype, laid out like the residual."""
        ctx = self.ctx
        # Rows are picked by token id, so the vocab dim is gathered whole and the
        # embed dim laid out like the activations; `ctx.param` carries the reduced
        # tag onto that rebuilt spec so the table's gradient stays unreduced.
        table_VxD = ctx.param(self.embedding_VxD[...], NAMES.embedding_lookup)
        x_BxSxD = pt.embed_lookup(table_VxD, tokens_BxS, ctx.spec(NAMES.residual))
        return ctx.act(x_BxSxD.astype(jnp.dtype(self.config.dtype)), NAMES.residual)

    def hidden(self, tokens_BxS, positions_BxS, segments_BxS):
        """(the last layer's output before the final norm, MoE stats)."""
        c = self.config
        x_BxSxD = self.embed(tokens_BxS)
        stats = {}
        if c.first_num_dense_layers:
            x_BxSxD, _ = _run_stack(self.dense_layers, x_BxSxD, positions_BxS, segments_BxS, c)
        if c.num_moe_layers and pipeline.stages(self.ctx) > 1:
            x_BxSxD, stats = self._run_pipelined(x_BxSxD, positions_BxS, segments_BxS)
        elif c.num_moe_layers:
            x_BxSxD, stats = _run_stack(self.moe_layers, x_BxSxD, positions_BxS, segments_BxS, c)
        return x_BxSxD, stats

    def _run_pipelined(self, x_BxSxD, positions_BxS, segments_BxS):
        """The MoE layers as the pipeline's stages (model/pipeline.py)."""
        c = self.config
        # One layer built for per-device code (the pipeline is one manual shard_map):
        # the same parameters, no constraints, the MoE layer's own shard_map off.
        manual = dataclasses.replace(self.ctx, mode="manual")
        layer = nnx.eval_shape(lambda: Block(c, manual, True, rngs=nnx.Rngs(0)))
        graphdef = nnx.split(layer)[0]
        _, state = nnx.split(self.moe_layers)
        return pipeline.run_pipeline(
            graphdef,
            state,
            x_BxSxD,
            positions_BxS,
            segments_BxS,
            ctx=self.ctx,
            microbatches=self.ctx.pipeline_microbatches,
            repeats=self.ctx.pipeline_repeats,
            layout=pipeline_slots.stack_slots(
                c, pipeline.stages(self.ctx), self.ctx.pipeline_repeats
            ),
            remat=lambda body: _remat(body, c),
        )

    def head(self, x_BxSxD):
        """The output head on normed states: logits_BxSxV in f32."""
        ctx, dt = self.ctx, jnp.dtype(self.config.dtype)
        logits = ctx.einsum(
            "bsd,dv->bsv",
            x_BxSxD,
            ctx.weight(self.logits_DxV[...].astype(dt), NAMES.logits_kernel),
            out=NAMES.logits,
        )
        return logits.astype(jnp.float32)

    def with_mtp(self, batch: dict, consume, depths: int | None = None):
        """The main logits and MoE stats, then each MTP depth's `consume(logits,
        targets, weights)` (model/mtp.py): ((logits, stats), [per depth], MTP MoE
        stats stacked over depth). `depths`: run only the first ones (evaluation)."""
        c = self.config
        hidden_BxSxD, stats = self.hidden(batch["inputs"], batch["positions"], batch["segments"])
        logits = self.head(self.final_norm(hidden_BxSxD))
        graphdef, state = nnx.split(self.mtp)

        def depth(h_BxSxD, e_BxSxD, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            h_BxSxD, depth_stats = layer(h_BxSxD, e_BxSxD, batch["positions"], batch["segments"])
            return h_BxSxD, layer.head_norm(h_BxSxD), depth_stats

        depth = _remat(depth, c)
        results, depth_stats = [], []
        for k in range(1, (depths or c.mtp_num_layers) + 1):
            inputs_BxS, targets_BxS, weights_BxS = depth_targets(batch, k, self.ctx)
            hidden_BxSxD, normed_BxSxD, s = depth(
                hidden_BxSxD, self.embed(inputs_BxS), _layer_slice(state, k - 1)
            )
            results.append(consume(self.head(normed_BxSxD), targets_BxS, weights_BxS))
            depth_stats.append(s)
        mtp_stats = jax.tree.map(lambda *xs: jnp.stack(xs), *depth_stats) if depth_stats else {}
        return (logits, stats), results, mtp_stats
