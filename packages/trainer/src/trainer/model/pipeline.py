"""Pipeline parallelism: the MoE layers split into stages on the 'stage' mesh axis.

The stacked MoE layers (leading layer dim, `model/decoder.py`) are sharded over
'stage' on that dim: stage s holds slots [s x S/p, (s+1) x S/p) of the S-slot
stack (S = L, or with uneven stages L padded to p x r equal chunks:
`config.pipeline.layer_slots`, `model/pipeline_slots.py`; a padding slot passes
its input through). The step's
microbatches (the gradient accumulation's, `accum.split_microbatches`' rows) go
through a GPipe schedule of m + p - 1 iterations: in each, every stage runs its
layers on the microbatch it holds and passes the result to the next stage by one
collective-permute over 'stage' (stage p-1's result wraps round to stage 0, which
keeps it as that microbatch's output). Autodiff of the whole loop is the
backward schedule: all forwards, then all backwards, the layers' parameter
cotangents summed over microbatches inside the backward loop.

Circular stages (`repeats` r > 1, MaxText's num_pipeline_repeats): the stack is
p x r chunks and stage s runs chunks s, s + p, ... as its repeats, m x r + p - 1
iterations; a microbatch's pass through the stages ends on stage 0, which keeps it
until its next repeat starts (m >= p: it is back in time). The stored layout stays
GPipe's (checkpoints do not depend on p or r): each stage's chunks are brought to it
by permutes once per step, before the loop (`circular_tables`).

The loop runs inside one `jax.shard_map` over every mesh axis (per device, the
model's 'manual' ShardCtx, as the floor step: `run/floor.py`). JAX 0.10's
`vmap` cannot map over a value tagged `reduced` and a partly manual shard_map
cannot take one, so the stages are not a vmap over the stage dim; inside a
fully manual map each device holds its own stage's layers and its own data rows.

Tags at the stage boundary: each stacked parameter enters with its own spec
(`pspec_tags.spec_of`: 'stage' on the layer dim, `reduced={'data'}` where the
plan defers its reduction), so its cotangent leaves the map `unreduced` over
'data': the backward loop sums each device's partial gradients with no
collective, and accum's one reduction per step happens after it. The
activations crossing stages carry no tag (they are sharded over 'data', never
reduced over it). Everything outside the MoE layers (embedding, dense layers,
final norm, output layer, loss, MTP) runs before or after the pipeline on every
stage alike, on the same microbatches one at a time (model/pipeline_ends.py): the
training step hands `run_stacked` the hidden states already split (m, B/m, S, D)
and takes its outputs so; `run_pipeline` (the whole batch: evaluation) splits and
merges around it.

Inside the stages: the batch axes (data, dcn_data; ZeRO-1 after the step), FSDP and
expert parallelism. FSDP (fsdp, dcn_fsdp): each stage's weights are all-gathered
over those axes once per step, before the loop (`gather_fsdp`), whose transpose is
the gradients' reduce-scatter once after the backward loop; a device then holds its
stage's weights whole for the step. Experts: the routed kernels enter as
P('stage', 'expert', ...) and stay so; the layer (built with the 'manual' ctx,
`model/moe_block.py`) runs moe_kernels' manual mode (`ManualExperts`), the routed
rows moved to their experts' devices by all-to-all over 'expert' inside the loop
(activations: nothing reduced). Tensor parallelism: the attention's head-split
weights (wq_b, wkv_b, wo over 'tensor') enter split and the layer runs Megatron's
way, `ShardCtx.einsum` (manual mode) psumming over 'tensor' the output projection's
partial sums, in the loop (activations, never a gradient); the MoE block runs whole
over 'tensor', as it does outside the pipeline, its weights gathered over it once per
step before the map (`whole_over_tensor`), the gather's transpose a slice. The
weights that enter whole over 'tensor' (norms, the latent projections, the MoE
block's) are invariant over it: their gradients come out alike on every tensor
device with no collective (the head-split projection's input cotangent is psummed,
as in Megatron, by the implicit cast to varying its invariant input takes there).
Context parallelism: the rows' sequence is split over 'context' (the hidden states
crossing stages too); attention gathers its keys and values whole along it
(`ShardCtx.relayout`: an all-gather in the loop, its transpose a reduce-scatter of
activation cotangents) and masks by position, so a query chunk sees its own
offset; fused kernels (cuDNN, splash) are not chosen on a chunk. tensor_transpose
splits the embed dim, which every norm and projection would have to sum by hand,
and is refused (config/pipeline.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import accum
import pspec_tags as pt
from trainer.config import STAGE_AXIS
from trainer.model.params import logical_axes_of
from trainer.model.pipeline_slots import Slots
from trainer.model.stage_weights import (
    gather_fsdp,
    own_spec,
    varying,
    whole_over_tensor,
    whole_over_tensor_leaf,
)
from trainer.sharding import ShardCtx

# MoE statistics the pipeline returns: per layer and token shard, summed over the
# microbatches as accum sums them.
SUMMED_STATS = ("tokens_per_expert_by_shard", "dropped_by_shard")
# Averaged over the microbatches: accum sums it with its term count, which one call
# of the pipelined loss counts once (train_step.make_loss_fn's metric).
MEAN_STATS = ("balance_loss_by_shard",)
# Kept per microbatch, (layers, token shards, microbatches): the balance loss is a
# term per microbatch, weighted by that microbatch's tokens (train_step's
# load_balance_loss_weight), so a sum over microbatches would not give it. Only
# when `run_stacked(per_microbatch_balance=True)`: it is differentiated through.
BALANCE_BY_MICROBATCH = "balance_loss_by_microbatch"
# Each token's router z summed over the MoE layers, (m, B/m, S) laid out as the
# microbatches' rows: the z-loss weighs every token with its target's weight
# (train_step), so it leaves the pipeline per token. Present when the layers return
# "router_z_BxS" (moe_z_loss_coeff > 0).
Z_BY_MICROBATCH = "router_z_by_microbatch"


def stages(ctx: ShardCtx) -> int:
    """The pipeline's stage count: the 'stage' mesh axis' size (1: no pipeline)."""
    return dict(ctx.mesh.shape).get(STAGE_AXIS, 1)


def _stacked_spec(variable: nnx.Variable, ctx: ShardCtx) -> P:
    """A stacked layer variable's spec: its own (explicit mode, tags included), or in
    auto mode its logical axes' ('stage_layers' first, as model.define lays it out)."""
    return own_spec(variable[...], ("stage_layers", *logical_axes_of(variable)), ctx)


def _merge_microbatches(x: jax.Array, spec: P | None) -> jax.Array:
    """(m, B/m, ...) -> (B, ...): the inverse of accum.split_microbatches' strided
    split, which moves no data (each device's rows stay its own)."""
    m, rows = x.shape[:2]
    y = jnp.swapaxes(x, 0, 1)  # a local transpose: the batch axes follow their dimension
    if spec is None:
        return y.reshape(m * rows, *x.shape[2:])
    return jnp.reshape(y, (m * rows, *x.shape[2:]), out_sharding=spec)


def circular_tables(p: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the circular layout's chunks come from, per permute round d (stage b sends
    to stage b + d mod p): `send[d, b]` the local chunks b sends, `recv[d, s]` the
    repeats they become on s (`r` pads: a slot thrown away). Chunk c of the layer
    stack (layers c x lps ...) is stored on stage c // r (the contiguous sharding)
    and run by stage c mod p as its repeat c // p (with uneven stages, c slots of the
    padded stack: config.pipeline.layer_slots)."""
    width = -(-r // p)  # the most chunks one stage sends another
    send = np.zeros((p, p, width), np.int32)
    recv = np.full((p, p, width), r, np.int32)
    for d in range(p):
        for b in range(p):
            s = (b + d) % p
            repeats = [k for k in range(r) if (k * p + s) // r == b]
            for n, k in enumerate(repeats):
                send[d, b, n], recv[d, s, n] = (k * p + s) % r, k
    return send, recv


def _circular_chunks(local_state: Any, stage, p: int, r: int, ctx: ShardCtx) -> Any:
    """This stage's layers as (repeats, layers per chunk, ...), repeat k being the
    stack's chunk k x p + stage: GPipe's own block (r = 1), or gathered from the
    stages that store them by p - 1 rounds of permutes (once per step, outside the
    pipeline loop; the backward sends the gradients home the same way)."""
    if r == 1:
        return jax.tree.map(lambda w: w[None], local_state)
    send, recv = (jnp.asarray(a) for a in circular_tables(p, r))

    def relayout(w):
        stored = w.reshape(r, w.shape[0] // r, *w.shape[1:])
        out = jnp.zeros((r + 1, *stored.shape[1:]), w.dtype)
        out = varying(out, (STAGE_AXIS, *ctx.token_axes))
        for d in range(p):
            piece = stored[send[d, stage]]
            if d:
                piece = lax.ppermute(piece, STAGE_AXIS, [(b, (b + d) % p) for b in range(p)])
            out = out.at[recv[d, stage]].set(piece)
        return out[:r]

    return jax.tree.map(relayout, local_state)


def _stored_order(stats: dict, stage, p: int, r: int) -> dict:
    """Per-layer stats (repeats, layers per chunk, ...) of this stage's chunks, as the
    layers this stage stores (its contiguous block of the stack)."""
    if r == 1:
        return {k: v.reshape(-1, *v.shape[2:]) for k, v in stats.items()}

    def block(v):
        every = lax.all_gather(v, STAGE_AXIS)  # (stages, repeats, lps, ...): small counts
        by_chunk = jnp.swapaxes(every, 0, 1).reshape(r * p, *v.shape[1:])
        mine = lax.dynamic_slice_in_dim(by_chunk, stage * r, r, 0)
        return mine.reshape(-1, *v.shape[2:])

    return {k: block(v) for k, v in stats.items()}


def run_pipeline(
    graphdef: Any,
    state: Any,
    x_BxSxD,
    positions_BxS,
    segments_BxS,
    *,
    ctx: ShardCtx,
    microbatches: int,
    repeats: int = 1,
    layout: Slots | None = None,
    remat,
) -> tuple[jax.Array, dict]:
    """The stacked layers `state` (layer dim sharded over 'stage') run as a GPipe
    pipeline over `microbatches` microbatches of the batch: `run_stacked` on the
    batch split as accum splits it, its output merged back (the whole-batch path:
    evaluation; the training step hands over microbatches, model/pipeline_ends.py).
    Returns (x_BxSxD, MoE stats stacked over the layers) like the unpipelined scan.
    """
    inputs = accum.split_microbatches(
        {"x": x_BxSxD, "positions": positions_BxS, "segments": segments_BxS}, microbatches
    )
    outputs, stats = run_stacked(
        graphdef, state, inputs, ctx=ctx, repeats=repeats, layout=layout, remat=remat
    )
    return _merge_microbatches(outputs, pt.spec_of(x_BxSxD)), stats


def run_stacked(
    graphdef: Any,
    state: Any,
    inputs: dict,
    *,
    ctx: ShardCtx,
    repeats: int = 1,
    layout: Slots | None = None,
    remat,
    per_microbatch_balance: bool = False,
    router_z: bool = False,
) -> tuple[jax.Array, dict]:
    """The pipeline on microbatches already split: `inputs` {"x": (m, B/m, S, D),
    "positions", "segments": (m, B/m, S)}, accum.split_microbatches' layout.

    `graphdef`: one layer's module built with the 'manual' ShardCtx (it runs per
    device); `remat`: the configured rematerialization applied to one layer.
    `layout`: uneven stages' padded stack (model/pipeline_slots.py): its padding
    slots pass their input through (zero gradient) and their stats are dropped.
    Returns (outputs (m, B/m, S, D) laid out as inputs["x"], MoE stats stacked
    over the layers); with `per_microbatch_balance` also BALANCE_BY_MICROBATCH, with
    `router_z` (the layers must return their tokens' router z) Z_BY_MICROBATCH.
    """
    m, p, r = inputs["x"].shape[0], stages(ctx), repeats
    x_spec = own_spec(inputs["x"], (None, "activation_batch", "activation_length", None), ctx)
    row_spec = own_spec(inputs["positions"], (None, "activation_batch", "activation_length"), ctx)
    in_row_specs = {"x": x_spec, "positions": row_spec, "segments": row_spec}
    state_specs = jax.tree.map(
        lambda v: _stacked_spec(v, ctx), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    state, state_specs = whole_over_tensor(state, state_specs, ctx, whole_over_tensor_leaf)
    # Per-layer stats, (layers, token shards, ...): the layer dim over 'stage', the
    # shard dim over the token axes (each device's own rows).
    token_axes = pt.entry_from_axes(ctx.token_axes)

    # One layer's weights picked from the stage's chunks by (repeat, slot) and
    # recomputed in the backward rather than kept: a picked copy kept as a residual
    # is stacked by both loops, the stage's whole weights once per pipeline
    # iteration (deepseek3-671b: about 3.3 GB a device an iteration, most of its
    # HLO temporaries). Kept, the chunks are a loop constant, saved once.
    pick = jax.checkpoint(
        lambda chunks, repeat, slot: jax.tree.map(
            lambda w: lax.dynamic_index_in_dim(
                lax.dynamic_index_in_dim(w, repeat, 0, False), slot, 0, False
            ),
            chunks,
        )
    )

    def layer(x, chunks, repeat, slot, positions, segments):
        return nnx.merge(graphdef, pick(chunks, repeat, slot))(x, positions, segments)

    layer = remat(layer)

    # Uneven stages: which slot of each chunk (in layer order) holds a real layer.
    real_table = None if layout is None else jnp.asarray(_real_table(layout, p * r))

    def stage_layers(chunks, repeat, x, positions, segments, real=None):
        """The layers of chunk `repeat` of this stage's `chunks` on x, in order."""
        slots = jax.tree.leaves(chunks)[0].shape[1]

        def body(x, slot_real):
            slot, is_real = slot_real
            y, stats = layer(x, chunks, repeat, slot, positions, segments)
            kept = (*SUMMED_STATS, *MEAN_STATS, "router_z_BxS")
            stats = {k: stats[k] for k in kept if k in stats}
            if is_real is None:
                return y, stats
            # A padding slot (zero weights) passes x through: its weights' cotangent
            # is zero, so AdamW keeps them zero; its stats are zeros, dropped later.
            y = jnp.where(is_real, y, x)
            return y, jax.tree.map(lambda v: jnp.where(is_real, v, jnp.zeros_like(v)), stats)

        # The stage's own layers make x its own: varying over 'stage' from the start.
        return lax.scan(body, varying(x, (STAGE_AXIS,)), (jnp.arange(slots), real))

    def per_device(local_state, rows):
        # TAG: the layers' parameters cast to vary over the token axes once, before
        # the loop, as the floor step does: each device's gradient then stays its
        # own through the backward loop, and this cast's transpose, after it, leaves
        # it `unreduced` over 'data' (the in_spec's `reduced`), not psummed.
        local_state = jax.tree.map(lambda w: varying(w, ctx.token_axes), local_state)
        # FSDP: the stage's weights whole on each device, gathered once per step (the
        # transpose: one reduce-scatter per weight after the backward loop, none in it).
        local_state = jax.tree.map(
            lambda spec, v: jax.tree.map(lambda w: gather_fsdp(w, spec), v),
            state_specs,
            local_state,
            is_leaf=lambda x: isinstance(x, P),
        )
        # The microbatches too, over 'stage': stage 0 takes them in, and the cast's
        # transpose sums their cotangents over the stages once, after the backward
        # loop, not once per iteration.
        rows = jax.tree.map(lambda r: varying(r, (STAGE_AXIS,)), rows)
        stage = lax.axis_index(STAGE_AXIS)
        forward = [(i, (i + 1) % p) for i in range(p)]
        # (repeats, layers per chunk, ...): this stage's chunks in the order it runs them.
        chunks = _circular_chunks(local_state, stage, p, r, ctx)
        first = jax.tree.map(lambda r_: r_[0], rows)
        _, stats_shape = jax.eval_shape(
            stage_layers,
            chunks,
            0,
            first["x"],
            first["positions"],
            first["segments"],
        )

        def iteration(carry, t):
            held, outputs, stats_sum = carry
            # The one collective of an iteration: each stage's result moves to the
            # next stage; stage 0 receives stage p-1's, a microbatch through one
            # pass of the stages, and keeps it (`outputs`) until its next repeat.
            arrived = jax.tree.map(lambda v: lax.ppermute(v, STAGE_AXIS, forward), held)
            done = t - p  # the pass stage p-1 finished last iteration
            keep = jnp.logical_and(stage == 0, done >= 0)
            slot = jnp.clip(done, 0, m * r - 1) % m
            outputs = lax.dynamic_update_index_in_dim(
                outputs,
                jnp.where(keep, arrived["x"], lax.dynamic_index_in_dim(outputs, slot, 0, False)),
                slot,
                0,
            )
            # Stage 0 starts pass t: microbatch t mod m, fresh in the first repeat,
            # from its kept output after that (kept since m >= p iterations ago).
            take = lambda v: lax.dynamic_index_in_dim(v, t % m, 0, False)  # noqa: E731
            new = {k: take(v) for k, v in rows.items()}
            new["x"] = jnp.where(t < m, new["x"], take(outputs))
            current = jax.tree.map(lambda n, a: jnp.where(stage == 0, n, a), new, arrived)
            # This stage holds pass t - stage: repeat (t - stage) // m, or the bubble.
            repeat = jnp.clip((t - stage) // m, 0, r - 1)
            real = None if real_table is None else real_table[repeat * p + stage]
            y, stats = stage_layers(
                chunks, repeat, current["x"], current["positions"], current["segments"], real
            )
            busy = jnp.logical_and(t - stage >= 0, t - stage < m * r)
            by_microbatch = stats_sum.get(BALANCE_BY_MICROBATCH)
            z_sum = stats_sum.get(Z_BY_MICROBATCH)
            summed = {k: v for k, v in stats_sum.items() if k in (*SUMMED_STATS, *MEAN_STATS)}
            stats_sum = jax.tree.map(
                lambda acc, v: lax.dynamic_update_index_in_dim(
                    acc,
                    lax.dynamic_index_in_dim(acc, repeat, 0, False) + jnp.where(busy, v, 0),
                    repeat,
                    0,
                ),
                summed,
                {k: stats[k] for k in summed},
            )
            if by_microbatch is not None:
                # This stage's pass t - stage is microbatch (t - stage) mod m.
                # Written once, while busy: a bubble iteration keeps what is there.
                index = (repeat, *(0,) * (by_microbatch.ndim - 2), (t - stage) % m)
                sizes = (1, *by_microbatch.shape[1:-1], 1)
                held_value = lax.dynamic_slice(by_microbatch, index, sizes)
                balance = stats["balance_loss_by_shard"][None, ..., None]
                stats_sum[BALANCE_BY_MICROBATCH] = lax.dynamic_update_slice(
                    by_microbatch, jnp.where(busy, balance, held_value), index
                )
            if z_sum is not None:
                # The stage's layers' z of microbatch (t - stage) mod m, added to what
                # its earlier repeats left (the other stages' layers: the psum below).
                mb = (t - stage) % m
                z = jnp.where(busy, jnp.sum(stats["router_z_BxS"], axis=0), 0)
                stats_sum[Z_BY_MICROBATCH] = lax.dynamic_update_index_in_dim(
                    z_sum, lax.dynamic_index_in_dim(z_sum, mb, 0, False) + z, mb, 0
                )
            return ({**current, "x": y}, outputs, stats_sum), None

        held = jax.tree.map(lambda r_: jnp.zeros_like(r_[0]), rows)
        # The layers return their z whenever the z-loss is on; it leaves the map only
        # where asked (`router_z`: the training loss, not evaluation).
        z_shape = stats_shape.pop("router_z_BxS", None)
        zeros = jax.tree.map(lambda s: jnp.zeros((r, *s.shape), s.dtype), stats_shape)
        if router_z:
            zeros[Z_BY_MICROBATCH] = jnp.zeros((m, *z_shape.shape[1:]), z_shape.dtype)
        if per_microbatch_balance:
            shape = stats_shape["balance_loss_by_shard"]
            zeros[BALANCE_BY_MICROBATCH] = jnp.zeros((r, *shape.shape, m), shape.dtype)
        carry = (held, jnp.zeros_like(rows["x"]), zeros)
        # Varying over 'stage' and the token axes from the start: each device's
        # carry is its own (its stage's layers, its own rows).
        carry = jax.tree.map(lambda v: varying(v, (STAGE_AXIS, *ctx.token_axes)), carry)
        iterations = jnp.arange(m * r + p - 1)
        (held, outputs, stats_sum), _ = lax.scan(iteration, carry, iterations)
        # The last microbatch, still on stage p-1: one more permute brings it home.
        arrived = lax.ppermute(held["x"], STAGE_AXIS, forward)
        outputs = lax.dynamic_update_index_in_dim(
            outputs, jnp.where(stage == 0, arrived, outputs[m - 1]), m - 1, 0
        )
        # Stage 0 holds every output: handed to all stages (the head runs on each),
        # one activation-sized reduction over 'stage' per step.
        outputs = lax.psum(jnp.where(stage == 0, outputs, jnp.zeros_like(outputs)), STAGE_AXIS)
        stats_sum = {k: v / m if k in MEAN_STATS else v for k, v in stats_sum.items()}
        z_sum = stats_sum.pop(Z_BY_MICROBATCH, None)
        stats_sum = _stored_order(stats_sum, stage, p, r)
        if z_sum is not None:
            # Each stage holds its own layers' share: one token-sized sum per step.
            stats_sum[Z_BY_MICROBATCH] = lax.psum(z_sum, STAGE_AXIS)
        return outputs, stats_sum

    def stats_spec(leaf_ndim: int) -> P:
        return P(STAGE_AXIS, token_axes, *(None,) * (leaf_ndim - 2))

    out_stats_specs = {
        k: stats_spec(3 if k == "tokens_per_expert_by_shard" else 2)
        for k in (*SUMMED_STATS, *MEAN_STATS)
    }
    if per_microbatch_balance:
        out_stats_specs[BALANCE_BY_MICROBATCH] = stats_spec(3)
    if router_z:
        out_stats_specs[Z_BY_MICROBATCH] = row_spec
    mapped = jax.shard_map(
        per_device,
        mesh=ctx.mesh,
        in_specs=(state_specs, in_row_specs),
        out_specs=(x_spec, out_stats_specs),
    )
    outputs, stats = mapped(state, inputs)
    if layout is not None:
        # The real layers' stats, in layer order: per-layer stats stay L long.
        stats = {k: v if k == Z_BY_MICROBATCH else _real_rows(v, layout) for k, v in stats.items()}
    return outputs, stats


def _real_table(layout: Slots, chunks: int) -> np.ndarray:
    """(chunks, slots per chunk) bools: which slots of the padded stack are layers."""
    real = np.zeros(layout.size, bool)
    real[np.asarray(layout.slots)] = True
    return real.reshape(chunks, -1)


def _real_rows(v: jax.Array, layout: Slots) -> jax.Array:
    """`v`'s rows of the real layers (its leading dim the padded stack's slots)."""
    spec = pt.spec_of(v)
    if spec is not None:
        # The layer dim whole first: L rows need not split over 'stage'.
        v = jax.sharding.reshard(v, P(None, *pt.partitions(spec)[1:]))
    return jnp.take(v, jnp.asarray(layout.slots), axis=0)
