"""One optimizer step: accumulated gradients (deferred reduction), AdamW, router biases."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import accum
import moe_kernels
from trainer import model as model_lib
from trainer.config import Config
from trainer.loss import cross_entropy_sum
from trainer.optimizer import learning_rate_schedule
from trainer.sharding import ShardCtx


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The pieces a run needs: state init and the step, both un-jitted."""

    init_opt_state: Callable[[Any], Any]
    step: Callable[[dict, dict], tuple[dict, dict]]


def make_loss_fn(config: Config, model: model_lib.ModelDef, router: dict) -> Callable:
    """`loss_fn(params, microbatch) -> (loss_sum, aux)` in accum's contract."""

    def loss_fn(params, mb):
        logits, stats = model_lib.apply(
            model, params, router, mb["inputs"], mb["positions"], mb["segments"]
        )
        # Without the aux loss, the loss and token count only need their totals
        # once per step: kept unreduced (explicit mode) they cost no collective
        # per microbatch. The aux loss scales by the microbatch's global token
        # count, so with it on that count is reduced here.
        aux_loss = bool(config.load_balance_loss_weight and stats)
        ce_sum, weight = cross_entropy_sum(
            logits, mb["targets"], mb["weights"], keep_unreduced=not aux_loss
        )
        aux = {"weight": weight, "ce_sum": ce_sum}
        loss_sum = ce_sum
        if stats:
            # (MoE layers, E) token counts: summed over microbatches by accum.
            # Per token shard, (MoE layers, shards, E), still sharded like the
            # tokens: accum sums it over microbatches with no collective, and the
            # one sum over shards happens after the loop. The global
            # `tokens_per_expert` would all-reduce the counts every microbatch.
            aux["tokens_per_expert_by_shard"] = stats["tokens_per_expert_by_shard"]
            # Likewise the balance loss for the metric, (MoE layers, shards),
            # and how many terms it holds (a constant), for the mean at the end.
            by_shard = stats["balance_loss_by_shard"]
            aux["balance_loss_by_shard"] = by_shard
            aux["balance_loss_terms"] = jnp.float32(by_shard.size)
            if aux_loss:
                balance = jnp.mean(stats["balance_loss"])
                loss_sum = loss_sum + config.load_balance_loss_weight * balance * weight
        return loss_sum, aux

    return loss_fn


def _update_router(config: Config, router: dict, tokens_per_expert_LxE) -> dict:
    if not router or config.routed_bias_update_rate == 0:
        return router
    update = jax.vmap(
        lambda b, t: moe_kernels.update_routing_bias(b, t, rate=config.routed_bias_update_rate)
    )
    ffn = router["moe_layers"]["ffn"]
    new_bias = update(ffn["bias"], tokens_per_expert_LxE)
    return {"moe_layers": {"ffn": {**ffn, "bias": new_bias}}}


def make_step(
    config: Config,
    ctx: ShardCtx,
    model: model_lib.ModelDef,
    tx: optax.GradientTransformation,
    zero1: tuple[Any, Any] | None = None,
    plan: accum.ReductionPlan | None = None,
) -> StepFns:
    """Build the step; `plan` (sharding.reduction_plan) decides every gradient reduction.

    With `zero1 = (compute_shardings, master_shardings)`, `state["params"]` are
    the data-sharded master parameters: they are gathered onto
    `compute_shardings` once before the microbatch loop, the single gradient
    reduction lands straight in `master_shardings` (a reduce-scatter where the
    backend forms one), and the optimizer updates shards only.
    """
    compute_dtype = jnp.dtype(config.dtype)

    def step(state: dict, batch: dict) -> tuple[dict, dict]:
        grad_shardings, params = None, state["params"]
        if zero1 is not None:
            compute_shardings, grad_shardings = zero1
            # One gather per step, before the loop. Weights the model casts to
            # the compute dtype at use are cast before the gather: the same
            # values in half the bytes, held through the loop.
            params = accum.zero1_gather(
                params,
                compute_shardings,
                compute_dtype=compute_dtype,
                cast=model.param_cast_at_use,
                mode=ctx.mode,
            )
        loss, aux, grads = accum.accumulate_gradients(
            make_loss_fn(config, model, state["router"]),
            params,
            batch,
            num_microbatches=config.gradient_accumulation_steps,
            mode=config.shard_mode,
            plan=plan,
            grad_shardings=grad_shardings,
            accum_dtype=jnp.dtype(config.accum_dtype),
            # Fusing works inside the layer scan: unscanned layers have none.
            fused=config.fused_gradient_accumulation and config.scan_layers,
            overlap=config.overlap_gradient_reduction,
            ring_reduce_scatter=config.ring_reduce_scatter,
        )
        return apply_gradients(config, tx, state, loss, aux, grads)

    return StepFns(init_opt_state=tx.init, step=step)


def apply_gradients(
    config: Config, tx: optax.GradientTransformation, state: dict, loss, aux: dict, grads
) -> tuple[dict, dict]:
    """The rest of a step once the batch's gradients are reduced: AdamW, router
    biases, step counter and metrics. `aux` is `loss_fn`'s, summed over the batch."""
    # The gradients as the optimizer sees them, in the parameters' dtype
    # (weight_dtype; accum.optimizer_update casts the same way): grad_norm's input.
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
    params, opt_state = accum.optimizer_update(tx, grads, state["opt_state"], state["params"])
    by_shard = aux.get("tokens_per_expert_by_shard")
    tokens = None if by_shard is None else jnp.sum(by_shard, axis=1)
    router = state["router"] if tokens is None else _update_router(config, state["router"], tokens)
    weight = jnp.maximum(aux["weight"], 1.0)
    metrics = {
        "loss": loss,
        "ce_loss": aux["ce_sum"] / weight,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": learning_rate_schedule(config)(state["step"]),
        "tokens": aux["weight"],
    }
    if tokens is not None:
        metrics["tokens_per_expert"] = tokens
        metrics["balance_loss"] = jnp.sum(aux["balance_loss_by_shard"]) / aux["balance_loss_terms"]
    new_state = {"params": params, "opt_state": opt_state, "router": router}
    new_state["step"] = state["step"] + 1
    return new_state, metrics
