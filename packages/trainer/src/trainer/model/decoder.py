"""The DeepSeek-style decoder: embeddings, dense then MoE blocks (scanned), logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import accum
import pspec_tags as pt
from trainer.config import ModelConfig
from trainer.model import lora, pipeline, pipeline_ends, pipeline_slots
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerViews:
    """A stacked parameter already split into its layers: what `unstack_layers` puts
    in place of a stacked leaf, so a layer loop run many times per step (each
    microbatch) reads each layer's own array instead of slicing the stack each time
    (on a GPU every slice feeding a matmul or a custom call is a copy kernel)."""

    layers: tuple


def _is_views(x) -> bool:
    return isinstance(x, LayerViews)


def unstack_layers(params: dict, stacks: tuple[str, ...]) -> dict:
    """`params` with every leaf under the top-level keys `stacks` split into its
    layers (LayerViews); other leaves as they are. Its VJP stacks the layers'
    gradients again (what accum's `prepare` pulls each microbatch's back through)."""

    def split(leaf):
        return LayerViews(
            tuple(jax.lax.index_in_dim(leaf, i, keepdims=False) for i in range(leaf.shape[0]))
        )

    return {k: jax.tree.map(split, v) if k in stacks else v for k, v in params.items()}


def _layer_count(state) -> int:
    first = jax.tree.leaves(state, is_leaf=_is_views)[0]
    return len(first.layers) if _is_views(first) else first.shape[0]


def _layer_slice(state, i: int):
    """Layer `i` of a stacked state (the leading axis dropped): a LayerViews leaf's
    own array, or a slice of the stack."""

    def pick(leaf):
        if _is_views(leaf):
            return leaf.layers[i]
        return jax.lax.index_in_dim(leaf, i, keepdims=False)

    return jax.tree.map(pick, state, is_leaf=_is_views)


def _layer_body(graphdef, positions_BxS, segments_BxS, config: ModelConfig):
    """`(x, one layer's state) -> (x, stats)` for a stack of `graphdef` blocks, with
    the configured rematerialization: a layer loop's scan body."""

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, positions_BxS, segments_BxS)

    return _remat(body, config)


def _run_stack(stack: nnx.Module, x_BxSxD, positions_BxS, segments_BxS, config: ModelConfig):
    """The stacked blocks in order; returns the output and per-layer stats (stacked).

    `scan_layers` runs them as one lax.scan (compile time independent of depth);
    otherwise as an unrolled Python loop over layer slices (same numbers).
    """
    graphdef, state = nnx.split(stack)
    body = _layer_body(graphdef, positions_BxS, segments_BxS, config)
    # run.resolve decides scan_layers=auto (config/layer_loop.py); a model defined
    # outside a run (a test, a notebook) scans under auto, as on a TPU or CPU.
    if config.scan_layers is not False:
        if any(_is_views(x) for x in jax.tree.leaves(state, is_leaf=_is_views)):
            raise ValueError(
                "parameters split into their layers (model.unstacked) run an unrolled "
                "layer loop: set scan_layers=false"
            )
        # accum.scan_layers is lax.scan, except inside fused gradient accumulation:
        # there each layer's gradient is added into the accumulator in the backward scan.
        return accum.scan_layers(body, x_BxSxD, state)
    per_layer = []
    for i in range(_layer_count(state)):
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
        graphdef, state, kwargs = self._pipeline_parts()
        return pipeline.run_pipeline(
            graphdef,
            state,
            x_BxSxD,
            positions_BxS,
            segments_BxS,
            microbatches=self.ctx.pipeline_microbatches,
            **kwargs,
        )

    def _pipeline_parts(self):
        """(one MoE layer's graphdef for per-device code, the stacked state, the
        pipeline's keyword arguments)."""
        c = self.config
        # One layer built for per-device code (the pipeline is one manual shard_map):
        # the same parameters, no constraints, the MoE layer's own shard_map off.
        layer = nnx.eval_shape(lambda: Block(c, self._manual(), True, rngs=nnx.Rngs(0)))
        kwargs = {
            "ctx": self.ctx,
            "repeats": self.ctx.pipeline_repeats,
            "layout": pipeline_slots.stack_slots(
                c, pipeline.stages(self.ctx), self.ctx.pipeline_repeats
            ),
            "remat": lambda body: _remat(body, c),
        }
        return nnx.split(layer)[0], nnx.split(self.moe_layers)[1], kwargs

    def _manual(self) -> ShardCtx:
        return dataclasses.replace(self.ctx, mode="manual")

    def pipelined_sums(self, batch: dict, token_nll, mtp_scale_D=None):
        """The training loss of the step's batch through the pipeline, every part of
        the model one pipeline microbatch at a time (model/pipeline_ends.py).
        `token_nll(logits, targets)`: the per-token loss (step/loss.py's).

        Returns (sums, MoE stats, MTP MoE stats): `sums` holds "ce_sum" and
        "weight" (the main head's Σ weight x nll and Σ weight) and with MTP, per
        depth, "mtp_ce_sum", "mtp_weight" and "mtp_scaled" (its Σ weight x
        mtp_scale_D[k] x nll), each an (n,) vector of per-token-shard partial sums
        sharded over the token axes: summed by the caller.
        """
        c, ctx = self.config, self.ctx
        rows = accum.split_microbatches(
            {k: batch[k] for k in ("inputs", "positions", "segments", "targets", "weights")},
            ctx.pipeline_microbatches,
        )
        dense = None
        params, logical = {"embedding": self.embedding_VxD[...]}, {"embedding": NAMES.embedding}
        if c.first_num_dense_layers:
            dense = nnx.split(
                nnx.eval_shape(lambda: Block(c, self._manual(), False, rngs=nnx.Rngs(0)))
            )[0]
            params["dense"], logical["dense"] = nnx.split(self.dense_layers)[1], True

        def embed_dense(p, mb):
            x = _lookup(p["embedding"], mb["inputs"], c)
            if dense is not None:
                x, _ = _scan_stack(dense, p["dense"], x, mb["positions"], mb["segments"], c)
            return x

        inputs = {k: rows[k] for k in ("inputs", "positions", "segments")}
        x = pipeline_ends.before(embed_dense, params, logical, inputs, ctx=ctx)
        graphdef, state, kwargs = self._pipeline_parts()
        positions = {"positions": rows["positions"], "segments": rows["segments"]}
        # The balance loss is a term per microbatch and the z-loss one per token
        # (train_step.make_loss_fn): they leave the pipeline so.
        moe = c.num_moe_layers > 0
        x, stats = pipeline.run_stacked(
            graphdef,
            state,
            {"x": x, **positions},
            **kwargs,
            per_microbatch_balance=bool(c.load_balance_loss_weight) and moe,
            router_z=bool(c.moe_z_loss_coeff) and moe,
        )
        params = {"logits": self.logits_DxV[...], "final_norm": nnx.split(self.final_norm)[1]}
        logical = {"logits": NAMES.logits_kernel, "final_norm": False}
        if c.mtp_num_layers:
            # The depths embed their shifted inputs with the main table.
            params["embedding"], logical["embedding"] = self.embedding_VxD[...], NAMES.embedding
            params["mtp"], logical["mtp"] = nnx.split(self.mtp)[1], True
        head_loss = _head_loss(
            c, self._manual(), nnx.split(self.final_norm)[0], self._manual_mtp(), token_nll
        )
        consts = () if mtp_scale_D is None else mtp_scale_D
        sums, mtp_stats = pipeline_ends.after(head_loss, params, logical, x, rows, consts, ctx=ctx)
        return sums, stats, mtp_stats

    def _manual_mtp(self):
        """One MTP depth's graphdef for per-device code (None: no MTP)."""
        c = self.config
        if not c.mtp_num_layers:
            return None
        moe = c.num_moe_layers > 0

        def make():
            r = nnx.Rngs(0)
            return MTPLayer(c, self._manual(), Block(c, self._manual(), moe, rngs=r), rngs=r)

        return nnx.split(nnx.eval_shape(make))[0]

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


def _lookup(table_VxD, tokens_BxS, config: ModelConfig):
    """Per device (inside a manual map): the embedding rows, cast after the lookup
    (f32 scatter-add in the backward, as Decoder.embed)."""
    return jnp.take(table_VxD, tokens_BxS, axis=0).astype(jnp.dtype(config.dtype))


def _scan_stack(graphdef, state, x_BxSxD, positions_BxS, segments_BxS, config: ModelConfig):
    """Per device: stacked blocks `state` (one block's manual `graphdef`) as a scan."""
    return jax.lax.scan(_layer_body(graphdef, positions_BxS, segments_BxS, config), x_BxSxD, state)


def _head_loss(config: ModelConfig, manual: ShardCtx, norm_graphdef, mtp_graphdef, token_nll):
    """Per device, one microbatch: `(params, h_BxSxD, rows, mtp_scale_D) -> (sums,
    MTP MoE stats)` of Decoder.pipelined_sums: the final norm, the head and its
    cross-entropy sums, then each MTP depth's (as Decoder.with_mtp)."""
    dt = jnp.dtype(config.dtype)

    def logits(p, normed_BxSxD):
        kernel = p["logits"].astype(dt)
        return jnp.einsum("bsd,dv->bsv", normed_BxSxD, kernel).astype(jnp.float32)

    def depth(h_BxSxD, e_BxSxD, layer_state, positions_BxS, segments_BxS):
        layer = nnx.merge(mtp_graphdef, layer_state)
        h_BxSxD, stats = layer(h_BxSxD, e_BxSxD, positions_BxS, segments_BxS)
        return h_BxSxD, layer.head_norm(h_BxSxD), stats

    depth = _remat(depth, config)

    def weighted_sums(nll_BxS, weights_BxS):
        # Per device: plain sums (the caller keeps the devices' partial sums apart).
        weights_BxS = weights_BxS.astype(jnp.float32)
        return jnp.sum(nll_BxS * weights_BxS), jnp.sum(weights_BxS)

    def head_loss(p, h_BxSxD, mb, scale_D):
        normed = nnx.merge(norm_graphdef, p["final_norm"])(h_BxSxD)
        nll_BxS = token_nll(logits(p, normed), mb["targets"])
        ce_sum, weight = weighted_sums(nll_BxS, mb["weights"])
        sums = {"ce_sum": ce_sum, "weight": weight}
        if mtp_graphdef is None:
            return sums, {}
        per_depth, tokens = {"mtp_ce_sum": [], "mtp_weight": [], "mtp_scaled": []}, []
        for k in range(1, config.mtp_num_layers + 1):
            inputs_BxS, targets_BxS, weights_BxS = depth_targets(mb, k, manual)
            h_BxSxD, normed, stats = depth(
                h_BxSxD,
                _lookup(p["embedding"], inputs_BxS, config),
                _layer_slice(p["mtp"], k - 1),
                mb["positions"],
                mb["segments"],
            )
            nll_BxS = token_nll(logits(p, normed), targets_BxS)
            ce_k, weight_k = weighted_sums(nll_BxS, weights_BxS)
            # The scale on the per-token weights, as train_step.make_loss_fn applies it.
            scaled_k, _ = weighted_sums(nll_BxS, weights_BxS * scale_D[k - 1])
            for key, v in zip(per_depth, (ce_k, weight_k, scaled_k), strict=True):
                per_depth[key].append(v)
            if "tokens_per_expert_by_shard" in stats:
                tokens.append(stats["tokens_per_expert_by_shard"])
        mtp_stats = {"tokens_per_expert_by_shard": jnp.stack(tokens)} if tokens else {}
        return {**sums, **per_depth}, mtp_stats

    return head_loss
