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
import pspec_tags as pt
from trainer import model as model_lib
from trainer.config import AccumulationConfig, ModelConfig, TrainingConfig
from trainer.model import mtp as mtp_lib
from trainer.model import pipeline
from trainer.sharding import ShardCtx
from trainer.step.loss import cross_entropy_sum, token_cross_entropy, weighted_sums
from trainer.step.optimizer import learning_rate_schedule


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The pieces a run needs: state init and the step, both un-jitted."""

    init_opt_state: Callable[[Any], Any]
    step: Callable[[dict, dict], tuple[dict, dict]]


def make_loss_fn(
    model: ModelConfig,
    model_def: model_lib.ModelDef,
    router: dict,
    mtp_scale_D: jax.Array | None = None,
    frozen: dict | None = None,
    pipelined: bool = False,
) -> Callable:
    """`loss_fn(params, microbatch) -> (loss_sum, aux)` in accum's contract.

    With MTP on, `mtp_scale_D` (`mtp_loss_scales` of the whole step's batch) turns
    each depth's cross-entropy sum into its share of the loss sum. With LoRA,
    `frozen` is the base parameters and `params` the adapters: the base is a constant
    of the differentiated function, so no gradient of it is ever computed or reduced.
    `pipelined` (pipeline stages): the model returns the loss sums itself, computed one
    pipeline microbatch at a time (model/pipeline_ends.py), not the batch's logits.
    """
    if model.mtp_num_layers and mtp_scale_D is None:
        raise ValueError("mtp_num_layers > 0 needs mtp_scale_D (train_step.mtp_loss_scales)")

    def loss_fn(params, mb):
        # Without the aux loss, the loss and token count only need their totals
        # once per step: kept unreduced (explicit mode) they cost no collective
        # per microbatch. The aux loss scales by the microbatch's global token
        # count, so with it on that count is reduced here. (Whether the model
        # has MoE layers is static: the config says.)
        aux_loss = bool(model.load_balance_loss_weight and model.num_moe_layers)

        keep = not aux_loss
        weights, adapters = (params, None) if frozen is None else (frozen, params)
        if pipelined:
            loss_sum, aux, stats, mtp_stats = _pipelined_sums(
                model, model_def, weights, router, mb, mtp_scale_D, keep
            )
        else:
            loss_sum, aux, stats, mtp_stats = _whole_batch_sums(
                model, model_def, weights, adapters, router, mb, mtp_scale_D, keep
            )
        if mtp_stats:
            # The MTP blocks' MoE token counts, (depths, shards, E): their router biases.
            aux["mtp_tokens_per_expert_by_shard"] = mtp_stats["tokens_per_expert_by_shard"]
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
            if model.capacity_factor:
                # Assignments dropped by the cap, (MoE layers, shards): summed like
                # the counts (no collective in the loop; the model's config says
                # statically whether a cap exists).
                aux["dropped_by_shard"] = stats["dropped_by_shard"]
            if model.moe_z_loss_coeff:
                if pipelined:
                    # Per pipeline microbatch and token, (m, B/m, S): the weights so too.
                    z = stats[pipeline.Z_BY_MICROBATCH]
                    weights = accum.split_microbatches(mb["weights"], z.shape[0])
                else:
                    z, weights = jnp.sum(stats["router_z_BxS"], axis=0), mb["weights"]
                loss_sum = loss_sum + _router_z_loss(model, z, weights, keep, aux)
            if aux_loss:
                loss_sum = loss_sum + model.load_balance_loss_weight * (
                    _pipelined_balance(stats, mb)
                    if pipelined
                    else jnp.mean(stats["balance_loss"]) * aux["weight"]
                )
        return loss_sum, aux

    return loss_fn


def _whole_batch_sums(model, model_def, weights, adapters, router, mb, mtp_scale_D, keep):
    """(loss sum, aux with the loss sums, MoE stats, MTP MoE stats) from the batch's
    logits (and each MTP depth's)."""
    mtp_stats: dict = {}
    if model.mtp_num_layers:
        (logits, stats), depths, mtp_stats = model_lib.apply_with_mtp(
            model_def,
            weights,
            router,
            mb,
            lambda lg, t, w: (token_cross_entropy(lg, t), w),
            adapters=adapters,
        )
    else:
        logits, stats = model_lib.apply(
            model_def,
            weights,
            router,
            mb["inputs"],
            mb["positions"],
            mb["segments"],
            adapters=adapters,
        )
    ce_sum, weight = cross_entropy_sum(logits, mb["targets"], mb["weights"], keep_unreduced=keep)
    aux = {"weight": weight, "ce_sum": ce_sum}
    loss_sum = ce_sum
    if model.mtp_num_layers:
        # Per depth (lists of scalars: accum sums and reduces each leaf once).
        sums = [weighted_sums(nll, w, keep_unreduced=keep) for nll, w in depths]
        aux["mtp_ce_sum"] = [s for s, _ in sums]
        aux["mtp_weight"] = [w for _, w in sums]
        for k, (nll_BxS, w_BxS) in enumerate(depths):
            # The scale goes on the per-token weights: an unreduced sum times a
            # replicated scalar would not type-check.
            scaled, _ = weighted_sums(nll_BxS, w_BxS * mtp_scale_D[k], keep_unreduced=keep)
            loss_sum = loss_sum + scaled
    return loss_sum, aux, stats, mtp_stats


def _pipelined_sums(model, model_def, weights, router, mb, mtp_scale_D, keep):
    """`_whole_batch_sums` with pipeline stages: the model's per-token-shard partial
    sums (Decoder.pipelined_sums), added up here: kept unreduced over the token axes
    as `keep` says (explicit mode), like the whole-batch path's."""
    sums, stats, mtp_stats = model_lib.apply_pipelined(
        model_def, weights, router, mb, token_cross_entropy, mtp_scale_D
    )
    # TAG: per-shard partial sums, sharded over the token axes: unreduced_sum leaves
    # them unreduced for accum's one reduction per step, as cross_entropy_sum does.
    total = pt.unreduced_sum if keep else jnp.sum
    aux = {"weight": total(sums["weight"]), "ce_sum": total(sums["ce_sum"])}
    loss_sum = aux["ce_sum"]
    if model.mtp_num_layers:
        aux["mtp_ce_sum"] = [total(s) for s in sums["mtp_ce_sum"]]
        aux["mtp_weight"] = [total(w) for w in sums["mtp_weight"]]
        for scaled in sums["mtp_scaled"]:
            loss_sum = loss_sum + total(scaled)
    return loss_sum, aux, stats, mtp_stats


def _pipelined_balance(stats: dict, mb: dict) -> jax.Array:
    """The balance loss term of the step's pipeline microbatches: each microbatch's
    balance loss (the mean over the MoE layers and token shards) times its own
    target weight, added up, as accum adds the unpipelined microbatches' terms."""
    balance_LxNxM = stats[pipeline.BALANCE_BY_MICROBATCH]
    balance_M = jnp.mean(balance_LxNxM, axis=(0, 1))
    weights_MxBxS = accum.split_microbatches(mb["weights"], balance_LxNxM.shape[-1])
    return jnp.sum(balance_M * jnp.sum(weights_MxBxS.astype(jnp.float32), axis=(1, 2)))


def _router_z_loss(model: ModelConfig, z_BxS, weights_BxS, keep: bool, aux: dict):
    """moe_z_loss_coeff x the router z-loss of every MoE layer, as a loss *sum*.

    Megatron-Core's z-loss (ST-MoE): per layer, coeff x mean over tokens of
    logsumexp(router logits)^2, the layers' terms added. `z_BxS`: each token's z
    summed over the MoE layers, laid out like `weights_BxS` (with pipeline stages
    both are (m, B/m, S), per pipeline microbatch). Each token's z counts with its
    target's weight, as its cross-entropy does (accum divides the loss sum by the
    step's weight). Summed per token with `weighted_sums`, exactly like the
    cross-entropy: without the aux loss the sum stays unreduced through the
    microbatch loop, so the z-loss adds no collective there; the coefficient rides
    on the per-token weights (an unreduced sum times a scalar would not
    type-check). `aux["router_z_sum"]` keeps the scaled sum for the metric.
    """
    spec = pt.spec_of(weights_BxS)
    if spec is not None and pt.spec_of(z_BxS) != spec:
        # TAG: an activation (no tag) onto the weights' layout (the residual's may shard
        # the sequence where the batch does not): the product below stays elementwise.
        z_BxS = jax.reshard(z_BxS, spec)
    weights_BxS = weights_BxS.astype(jnp.float32) * model.moe_z_loss_coeff
    z_sum, _ = weighted_sums(z_BxS, weights_BxS, keep_unreduced=keep)
    aux["router_z_sum"] = z_sum
    return z_sum


def mtp_loss_scales(model: ModelConfig, batch: dict, ctx: ShardCtx) -> jax.Array:
    """Per MTP depth, the factor that turns its cross-entropy sum into its share of
    the loss sum: mtp_loss_scaling_factor / depths x W / W_k, with W the batch's
    target weight and W_k depth k's. accum divides the loss sum by W, so the loss is
    main + factor x mean over depths of (sum_k / W_k). Depends on the batch only
    (no parameter): computed once per step, before the microbatch loop."""
    total = jnp.sum(batch["weights"].astype(jnp.float32))
    depth_totals = [
        jnp.sum(mtp_lib.depth_targets(batch, k, ctx)[2]) for k in range(1, model.mtp_num_layers + 1)
    ]
    weights_D = jnp.stack(depth_totals)
    per_depth = model.mtp_loss_scaling_factor / model.mtp_num_layers
    # A depth with no target at all in the batch adds nothing (not 0/0).
    return jnp.where(weights_D > 0, per_depth * total / jnp.maximum(weights_D, 1.0), 0.0)


def _update_router(
    model: ModelConfig, router: dict, tokens_per_expert_LxE, mtp_tokens=None, layout=None
) -> dict:
    if not router or model.routed_bias_update_rate == 0:
        return router
    if model.lora_rank and not model.lora_update_routing_bias:
        # LoRA leaves every base tensor as it was, the routing biases too: the
        # adapters alone then reproduce the run (a PEFT adapter holds nothing else).
        return router
    update = jax.vmap(
        lambda b, t: moe_kernels.update_routing_bias(b, t, rate=model.routed_bias_update_rate)
    )

    def updated(group: dict, tokens) -> dict:
        ffn = group["ffn"]
        return {**group, "ffn": {**ffn, "bias": update(ffn["bias"], tokens)}}

    if layout is not None:
        # Uneven pipeline stages: the biases' padded stack (model/pipeline_slots.py);
        # its padding slots count no token, which leaves their biases as they are.
        padded = jnp.zeros((layout.size, *tokens_per_expert_LxE.shape[1:]), jnp.float32)
        tokens_per_expert_LxE = padded.at[jnp.asarray(layout.slots)].set(tokens_per_expert_LxE)
        spec = pt.spec_of(router["moe_layers"]["ffn"]["bias"])
        if spec is not None:  # explicit mode: laid out as the biases (over 'stage')
            tokens_per_expert_LxE = jax.sharding.reshard(tokens_per_expert_LxE, spec)
    new = {"moe_layers": updated(router["moe_layers"], tokens_per_expert_LxE)}
    if "mtp" in router:
        new["mtp"] = {"block": updated(router["mtp"]["block"], mtp_tokens)}
    return new


def make_step(
    model: ModelConfig,
    training: TrainingConfig,
    accumulation: AccumulationConfig,
    ctx: ShardCtx,
    model_def: model_lib.ModelDef,
    tx: optax.GradientTransformation,
    zero1: tuple[Any, Any] | None,
    plan: accum.ReductionPlan,
) -> StepFns:
    """Build the step; `plan` (sharding.reduction_plan) decides every gradient reduction.

    With `zero1 = (compute_shardings, master_shardings)`, `state["params"]` are
    the data-sharded master parameters: they are gathered onto
    `compute_shardings` once before the microbatch loop, the single gradient
    reduction lands straight in `master_shardings` (a reduce-scatter where the
    backend forms one), and the optimizer updates shards only.
    """
    compute_dtype = jnp.dtype(model.dtype)
    schedule = accumulation.gradient_accumulation_schedule
    steps = accumulation.gradient_accumulation_steps
    if pipeline.stages(ctx) > 1:
        # The pipeline runs the microbatches (model/pipeline.py): accum sees the
        # step's batch as one, and its one reduction per step follows the pipeline
        # loop. fused has no layer scan to fuse into (the stages scan their own);
        # config/pipeline.py refuses the overlapped schedules.
        schedule, steps = "plain", 1
    if schedule == "fused" and (
        model_def.lora
        or not accum.fuses_in_scan(schedule, plan, steps, scans_layers=model.scan_layers)
    ):
        # Nothing to fuse into (unscanned layers have no layer scan), or LoRA: the
        # per-microbatch gradient is the adapters' (nothing to save), and the fused
        # layer stack's custom backward would differentiate the frozen base too.
        schedule = "plain"
    trained = model_lib.trained_view(model_def)
    # An unrolled layer loop run once per microbatch (GPUs' default layout) read every
    # layer's weights out of the f32 stacks in each microbatch (issue 53: the deviceless
    # H200 estimate, benchmarks/results/gpu_estimate.md). Both fixes below do that
    # work once per step, before the loop; one microbatch gains nothing from either.
    unrolled_loop = model.scan_layers is False and steps > 1
    # Cast at use, each microbatch re-read the f32 stack and wrote bf16; cast before
    # the loop, the loop reads bf16. ZeRO-1 casts in its gather (below); weights
    # stored in the compute dtype need no cast.
    casts = unrolled_loop and zero1 is None and compute_dtype != jnp.dtype(trained.weight_dtype)
    cast_once = cast_once_per_step(trained, plan) if casts else None
    # On a GPU a slice of a stack feeding a matmul or the grouped GEMM's custom call is
    # a copy kernel, one per weight, layer and microbatch. Split into its layers once
    # before the loop (accum's `prepare`), each microbatch reads a layer's own array;
    # accum stacks each microbatch's layer gradients again before adding them (XLA
    # fuses that into the addition). LoRA trains the adapters only (the frozen base is
    # no parameter of the loop).
    prepare = model_lib.unstacked if unrolled_loop and not model_def.lora else None

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
                cast=trained.param_cast_at_use,
                mode=ctx.mode,
            )
        elif cast_once is not None:
            # Weights the model casts at use, cast here instead: once per step, not
            # in every microbatch (each of which re-read the f32 stack). The loop
            # differentiates the compute-dtype copy, whose cotangent is the one the
            # cast at use carried; accum tags the copy reduced as it tags a
            # parameter, so the accumulator (accum_dtype) is reduced once per step.
            params = jax.tree.map(
                lambda p, c: p.astype(compute_dtype) if c else p, params, cast_once
            )
        mtp_scale_D = mtp_loss_scales(model, batch, ctx) if model.mtp_num_layers else None
        loss, aux, grads = accum.accumulate_gradients(
            make_loss_fn(
                model,
                model_def,
                state["router"],
                mtp_scale_D,
                state.get("frozen"),
                pipelined=pipeline.stages(ctx) > 1,
            ),
            params,
            batch,
            num_microbatches=steps,
            plan=plan,
            schedule=schedule,
            grad_shardings=grad_shardings,
            accum_dtype=jnp.dtype(accumulation.accum_dtype),
            prepare=prepare,
        )
        return apply_gradients(model, training, tx, state, loss, aux, grads, model_def.moe_layout)

    return StepFns(init_opt_state=tx.init, step=step)


def cast_once_per_step(trained: model_lib.ModelDef, plan: accum.ReductionPlan) -> Any:
    """Per trained leaf, whether the step casts it to the compute dtype once before
    the microbatch loop (None: no leaf is). A leaf qualifies when the model casts it
    at use (params.CAST_AT_USE) and no batch axis reduces its gradient inside the
    loop (accum.PER_MICROBATCH or SCATTER): there the reduction would carry the
    compute dtype instead of the f32 cotangent of the cast, so those leaves keep
    their cast at use. Same numbers either way."""

    def once(leaf: accum.LeafPlan, cast: bool) -> bool:
        return bool(cast) and not leaf.axes(accum.PER_MICROBATCH, accum.SCATTER)

    marks = plan.map(once, trained.param_cast_at_use)
    return marks if any(jax.tree.leaves(marks)) else None


def apply_gradients(
    model: ModelConfig,
    training: TrainingConfig,
    tx: optax.GradientTransformation,
    state: dict,
    loss,
    aux: dict,
    grads,
    moe_layout=None,
) -> tuple[dict, dict]:
    """The rest of a step once the batch's gradients are reduced: AdamW, router
    biases, step counter and metrics. `aux` is `loss_fn`'s, summed over the batch.
    `moe_layout`: the padded MoE stack of uneven pipeline stages (ModelDef.moe_layout)."""
    # The gradients as the optimizer sees them, in the parameters' dtype
    # (weight_dtype; accum.optimizer_update casts the same way): grad_norm's input.
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
    params, opt_state = accum.optimizer_update(tx, grads, state["opt_state"], state["params"])
    by_shard = aux.get("tokens_per_expert_by_shard")
    tokens = None if by_shard is None else jnp.sum(by_shard, axis=1)
    mtp_by_shard = aux.get("mtp_tokens_per_expert_by_shard")
    mtp_tokens = None if mtp_by_shard is None else jnp.sum(mtp_by_shard, axis=1)
    router = (
        state["router"]
        if tokens is None
        else _update_router(model, state["router"], tokens, mtp_tokens, moe_layout)
    )
    weight = jnp.maximum(aux["weight"], 1.0)
    metrics = {
        "loss": loss,
        "ce_loss": aux["ce_sum"] / weight,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": learning_rate_schedule(training)(state["step"]),
        "tokens": aux["weight"],
    }
    for k, (depth_sum, depth_weight) in enumerate(
        zip(aux.get("mtp_ce_sum", ()), aux.get("mtp_weight", ()), strict=True), 1
    ):
        metrics[f"mtp_loss_{k}"] = depth_sum / jnp.maximum(depth_weight, 1.0)
    if tokens is not None:
        metrics["tokens_per_expert"] = tokens
        metrics["balance_loss"] = jnp.sum(aux["balance_loss_by_shard"]) / aux["balance_loss_terms"]
        if "dropped_by_shard" in aux:
            # Share of each MoE layer's assignments (tokens x experts per token) dropped.
            dropped_L = jnp.sum(aux["dropped_by_shard"], axis=1).astype(jnp.float32)
            assigned_L = jnp.sum(tokens, axis=-1).astype(jnp.float32)
            metrics["dropped_share"] = dropped_L / jnp.maximum(assigned_L, 1.0)
    if "router_z_sum" in aux:
        # Unscaled, the mean over MoE layers of the weighted mean z (the loss adds
        # coeff x the layers' sum).
        per_layer = model.moe_z_loss_coeff * model.num_moe_layers
        metrics["router_z_loss"] = aux["router_z_sum"] / (weight * per_layer)
    new_state = {"params": params, "opt_state": opt_state, "router": router}
    if "frozen" in state:
        new_state["frozen"] = state["frozen"]  # the LoRA base: passed through untouched
    new_state["step"] = state["step"] + 1
    return new_state, metrics
