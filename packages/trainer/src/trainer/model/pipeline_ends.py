"""The pipeline's two ends, one microbatch at a time (issue #57).

With pipeline stages, accum hands the model the step's whole batch as one
microbatch and the pipeline (model/pipeline.py) splits it into m. What runs
before the MoE layers (the embedding and the dense layers) and after them (the
final norm, the output head, the cross-entropy and the MTP depths) runs here on
those same microbatches, one at a time: a `lax.scan` over the microbatch axis
whose iteration is one `jax.checkpoint`, so the forward keeps only its inputs
and the backward recomputes one microbatch's activations at a time. The
(tokens, vocab) f32 logits exist for one microbatch's tokens, not the step's;
the hidden states go to the pipeline stacked (m, B/m, S, D), the layout it runs
on, and come back so.

Each end is one `jax.shard_map` over every mesh axis, per device, as the
pipeline's loop (the model's 'manual' ShardCtx), with the same handling of the
parameters it reads (embedding, dense layers, final norm, head, MTP):

- TAG: each enters with its own spec (`stage_weights.own_spec`: `reduced={'data'}`
  where the plan defers its reduction) and is cast to vary over the token axes
  once, before the scan. Each device then differentiates its own rows against
  its own copy: the scan's backward sums the microbatches' cotangents per
  device, with no collective in the loop, and the cast's transpose after it
  leaves them `unreduced` over the deferred axes (explicit mode) or psums them
  once (auto mode, whose types carry no tags: outside a manual map XLA's
  partitioner would place each gradient's reduction itself).
- tensor: the ends run whole over 'tensor' (their weights gathered over it once
  per step, before the map; `stage_weights.whole_over_tensor`): the embedding's and the
  head's vocab splits would need a masked lookup and a vocab-split cross-entropy
  written by hand, and the ends are a few layers of the model's depth.
- FSDP: a weight sharded over fsdp / dcn_fsdp is gathered once per step, before
  the scan (`stage_weights.gather_fsdp`); its transpose, the gradient's reduce-scatter,
  runs once after the backward loop.

The loss comes out as per-device partial sums, one entry per token shard: the
caller adds them up (`pspec_tags.unreduced_sum` keeps them unreduced over the
token axes for accum's one reduction per step). Every stage computes the ends
alike, as before this module (the pipeline hands its output to every stage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import pspec_tags as pt
from trainer.model import stage_weights
from trainer.model.params import logical_axes_of
from trainer.sharding import ShardCtx

ROWS = (None, "activation_batch", "activation_length")  # (m, B/m, S)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(params: dict, logical: dict, ctx: ShardCtx) -> dict:
    """Per leaf of `params` (arrays or nnx states), its spec: its own, tags included
    (explicit mode), or its logical one (auto). `logical[k]`: the axes of an array
    leaf, or for a state whether its variables are stacked on a leading layer dim."""

    def of_state(state, stacked: bool):
        def one(v):
            axes = logical_axes_of(v, stacked=stacked)
            return stage_weights.own_spec(v[...], axes, ctx)

        return jax.tree.map(one, state, is_leaf=_is_variable)

    return {
        k: of_state(v, logical[k]) if isinstance(logical[k], bool) else (
            stage_weights.own_spec(v, logical[k], ctx)
        )
        for k, v in params.items()
    }  # fmt: skip


def _local_params(params: dict, specs: dict, ctx: ShardCtx) -> dict:
    """Inside the map: each parameter varying over the token axes, FSDP gathered."""
    # TAG: the cast to varying before the scan: each device's gradient stays its
    # own through the backward loop; the cast's transpose, after the loop, leaves it
    # unreduced over the in_spec's `reduced` axes (psummed once in auto mode).
    params = jax.tree.map(lambda w: stage_weights.varying(w, ctx.token_axes), params)
    return jax.tree.map(
        lambda spec, v: jax.tree.map(lambda w: stage_weights.gather_fsdp(w, spec), v),
        specs,
        params,
        is_leaf=lambda x: isinstance(x, P),
    )


def row_spec(rows: jax.Array, ctx: ShardCtx) -> P:
    """The (m, B/m, S) microbatch rows' spec: their own (explicit) or the logical one."""
    return stage_weights.own_spec(rows, ROWS, ctx)


def hidden_spec(rows_spec: P) -> P:
    """(m, B/m, S, D) hidden states laid out like their rows, the embed dim whole."""
    entries = tuple(rows_spec) + (None,) * (3 - len(tuple(rows_spec)))
    return P(*entries[:3], None)


def shard_entry(ctx: ShardCtx):
    """The token axes as one spec entry: a per-device partial sum's (n,) dim."""
    return pt.entry_from_axes(ctx.token_axes)


def before(
    embed_dense: Callable, params: dict, logical: dict, rows: dict, *, ctx: ShardCtx
) -> jax.Array:
    """`embed_dense(local params, one microbatch's rows) -> x (B/m, S, D)` per device,
    scanned over the microbatches: the stacked hidden states (m, B/m, S, D)."""
    params, specs = stage_weights.whole_over_tensor(params, param_specs(params, logical, ctx), ctx)
    rspec = row_spec(rows["inputs"], ctx)
    rows_specs = jax.tree.map(lambda _: rspec, rows)

    def per_device(params, rows):
        params = _local_params(params, specs, ctx)
        # One microbatch per iteration, recomputed in the backward (its inputs kept).
        one = jax.checkpoint(lambda mb: embed_dense(params, mb))
        _, xs = lax.scan(lambda c, mb: (c, one(mb)), None, rows)
        return xs

    mapped = jax.shard_map(
        per_device, mesh=ctx.mesh, in_specs=(specs, rows_specs), out_specs=hidden_spec(rspec)
    )
    return mapped(params, rows)


def after(
    head_loss: Callable,
    params: dict,
    logical: dict,
    hidden: jax.Array,
    rows: dict,
    consts: Any,
    *,
    ctx: ShardCtx,
) -> tuple[dict, dict]:
    """`head_loss(local params, h (B/m, S, D), rows, consts) -> (sums, stats)` per
    device, scanned over the microbatches, both summed over them.

    `sums`: a dict of scalars (or lists of them), returned as (n,) vectors of
    per-device partial sums, one entry per token shard (sharded over the token
    axes). `stats`: arrays with a token-shard dim of 1 per device at axis 1,
    returned with that dim over the token axes (like the pipeline's MoE stats).
    `consts`: replicated values every microbatch reads (the MTP loss scales).
    """
    params, specs = stage_weights.whole_over_tensor(params, param_specs(params, logical, ctx), ctx)
    rspec = row_spec(rows["inputs"], ctx)
    rows_specs = jax.tree.map(lambda _: rspec, rows)
    entry = shard_entry(ctx)

    def per_device(params, hidden, rows, consts):
        params = _local_params(params, specs, ctx)
        one = jax.checkpoint(lambda h, mb: head_loss(params, h, mb, consts))
        first = jax.tree.map(lambda v: v[0], (hidden, rows))
        shapes = jax.eval_shape(one, *first)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        # TAG: the sums are each device's own (its rows): varying from the start.
        zeros = jax.tree.map(lambda v: stage_weights.varying(v, ctx.token_axes), zeros)

        def iteration(total, xs):
            return jax.tree.map(jnp.add, total, one(*xs)), None

        (sums, stats), _ = lax.scan(iteration, zeros, (hidden, rows))
        return jax.tree.map(lambda s: s.reshape(1), sums), stats

    def stats_spec(leaf):
        return P(None, entry, *(None,) * (leaf.ndim - 2))

    in_specs = (specs, hidden_spec(rspec), rows_specs, jax.tree.map(lambda _: P(), consts))
    # The per-device outputs' structure and ranks, for the out_specs (a trace, no compute).
    shapes = jax.eval_shape(
        jax.shard_map(
            lambda p, h, r, c: head_loss(
                _local_params(p, specs, ctx), h[0], jax.tree.map(lambda v: v[0], r), c
            ),
            mesh=ctx.mesh,
            in_specs=in_specs,
            out_specs=P(),
            check_vma=False,
        ),
        params,
        hidden,
        rows,
        consts,
    )
    out_specs = (
        jax.tree.map(lambda _: P(entry), shapes[0]),
        jax.tree.map(stats_spec, shapes[1]),
    )
    mapped = jax.shard_map(
        per_device,
        mesh=ctx.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
    return mapped(params, hidden, rows, consts)
