"""Held-out evaluation: a forward-only eval step, compiled once, summed over the eval set.

The eval step runs the training model's forward (`model.apply`, the same
segments, positions and loss mask as training) on one eval batch under the
run's mesh, shardings and shard_mode, and adds each token's weighted
-log p(target) into per-token accumulators laid out like the tokens. Adding
elementwise into arrays sharded like the batch needs no collective, so the
host loop over eval batches runs only what the forward itself needs; the one
reduction of the loss and token sums happens once per evaluation, in
`finalize`, and the mean is taken once from the two totals.

With `mtp_eval_target_module=k`, the forward also runs the MTP depths up to k
and accumulates, per token, whether depth k's top-1 prediction is the token
actually k+1 ahead (over the positions where depth k has a target): the
acceptance rate a speculative decoder drafting with depth k would see.

The train state is only read: the eval step takes the parameters and router
biases without donating them (only its own accumulators are donated) and
returns nothing of the state, so an evaluation changes no parameter and no
optimizer state, and the training steps around it are the same with or
without evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

import accum
from trainer import data as data_lib
from trainer import model as model_lib
from trainer.config import DataConfig, EvaluationConfig, ParallelismConfig
from trainer.data import input_pipeline
from trainer.data.eval_data import EvalSet
from trainer.io.metrics import EVAL_MTP_ACCEPTANCE
from trainer.run import xla_options
from trainer.sharding import ShardCtx
from trainer.step.loss import token_cross_entropy, top1_hits


@dataclasses.dataclass
class Evaluator:
    """One run's eval step (compiled once) and the eval batches it reads."""

    parallelism: ParallelismConfig
    data: DataConfig
    evaluation: EvaluationConfig
    ctx: ShardCtx
    eval_set: EvalSet
    step_fn: Any  # jitted (params, router, batch, acc, frozen) -> acc
    finalize_fn: Any  # jitted acc -> {accumulator: its sum}, replicated
    zeros_fn: Any  # jitted () -> acc
    compiled: Any = None

    def batch(self, index: int) -> dict:
        """Eval batch `index` on the mesh, each process building only its rows."""
        length = self.data.max_target_length
        return input_pipeline.put_rows(self.eval_set.source, index, self.ctx, length)

    def compile(self, state: dict) -> Any:
        """Lower and compile the eval step once (the executable every evaluation runs)."""
        if self.compiled is None:
            with jax.set_mesh(self.ctx.mesh):
                lowered = self.step_fn.lower(
                    state["params"],
                    state["router"],
                    self.batch(0),
                    self.zeros_fn(),
                    state.get("frozen"),
                )
                options = xla_options.for_mesh(self.parallelism, self.ctx.mesh)
                self.compiled = lowered.compile(compiler_options=options)
        return self.compiled

    def evaluate(self, state: dict) -> dict:
        """Loss over the eval set: {eval_loss, eval_perplexity, eval_tokens, eval_time_s}."""
        start = time.perf_counter()
        compiled = self.compile(state)
        with jax.set_mesh(self.ctx.mesh):
            acc = self.zeros_fn()
            for index in range(self.eval_set.steps):
                acc = compiled(
                    state["params"], state["router"], self.batch(index), acc, state.get("frozen")
                )
            sums = jax.device_get(self.finalize_fn(acc))
        tokens = float(sums["weight"])
        loss = float(sums["loss"]) / max(tokens, 1.0)
        result = {
            "eval_loss": loss,
            "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "eval_tokens": int(tokens),
        }
        target = self.evaluation.mtp_eval_target_module
        if target:
            share = float(sums["mtp_hits"]) / max(float(sums["mtp_weight"]), 1.0)
            result[f"{EVAL_MTP_ACCEPTANCE}{target}"] = share
        result["eval_time_s"] = time.perf_counter() - start
        return result

    def describe(self) -> str:
        """The startup line: when, how much, from where."""
        steps = self.eval_set.steps
        tokens = steps * self.eval_set.batch_size * self.data.max_target_length
        return (
            f"eval: every {self.evaluation.eval_interval} steps and at the end, {steps} batches of "
            f"{self.eval_set.batch_size} sequences (<= {tokens:,} tokens) from "
            f"{self.eval_set.note}"
        )


def make_evaluator(
    parallelism: ParallelismConfig,
    data: DataConfig,
    evaluation: EvaluationConfig,
    ctx: ShardCtx,
    model: model_lib.ModelDef,
    eval_set: EvalSet | None,
) -> Evaluator | None:
    """The jitted eval step for this run's model and mesh (None when evaluation is off)."""
    if eval_set is None:
        return None
    shape = (eval_set.batch_size, data.max_target_length)
    token_sharding = data_lib.batch_shardings(ctx, *shape)["weights"]
    target = evaluation.mtp_eval_target_module
    keys = ("loss", "weight", "mtp_hits", "mtp_weight") if target else ("loss", "weight")
    acc_shardings = {key: token_sharding for key in keys}
    # ZeRO-1 keeps the master parameters sharded over 'data': the forward runs on
    # them gathered to the layout the train step computes with (the parameters'
    # own logical shardings), as the train step gathers them before its loop.
    # With LoRA the trained parameters are the adapters, and `frozen` the base.
    compute = None
    if parallelism.shard_optimizer_over_data:
        params_abstract, _ = model_lib.abstract_state(model_lib.trained_view(model), ctx)
        compute = jax.tree.map(lambda p: p.sharding.spec, params_abstract)

    def eval_step(params: dict, router: dict, batch: dict, acc: dict, frozen=None) -> dict:
        if compute is not None:
            params = accum.zero1_gather(params, compute, mode=ctx.mode)
        adapters = None
        if frozen is not None:
            params, adapters = frozen, params
        new = {}
        if target:
            (logits, _), depths, _ = model_lib.apply_with_mtp(
                model,
                params,
                router,
                batch,
                lambda lg, t, w: (top1_hits(lg, t), w),
                target,
                adapters=adapters,
            )
            hits, mtp_weights = depths[target - 1]
            new["mtp_hits"] = acc["mtp_hits"] + ctx.act(hits * mtp_weights, data_lib.TOKENS)
            new["mtp_weight"] = acc["mtp_weight"] + ctx.act(mtp_weights, data_lib.TOKENS)
        else:
            logits, _ = model_lib.apply(
                model,
                params,
                router,
                batch["inputs"],
                batch["positions"],
                batch["segments"],
                adapters=adapters,
            )
        weights = batch["weights"].astype(jnp.float32)
        nll = token_cross_entropy(logits, batch["targets"]) * weights
        # Laid out like the tokens, so adding into the accumulators is elementwise.
        nll = ctx.act(nll, data_lib.TOKENS)
        return {"loss": acc["loss"] + nll, "weight": acc["weight"] + weights, **new}

    def finalize(acc: dict) -> dict:
        # The evaluation's one reduction: a scalar per accumulator, once per evaluation.
        return {key: jnp.sum(value) for key, value in acc.items()}

    def zeros() -> dict:
        return {key: jnp.zeros(shape, jnp.float32) for key in acc_shardings}

    # Only the accumulators are donated: the parameters and router biases belong
    # to the train state, which the next train step donates and must find intact.
    step_fn = jax.jit(eval_step, donate_argnums=(3,), out_shardings=acc_shardings)
    replicated = jax.sharding.NamedSharding(ctx.mesh, jax.sharding.PartitionSpec())
    finalize_fn = jax.jit(finalize, out_shardings={key: replicated for key in keys})
    zeros_fn = jax.jit(zeros, out_shardings=acc_shardings)
    return Evaluator(parallelism, data, evaluation, ctx, eval_set, step_fn, finalize_fn, zeros_fn)


def eval_line(step: int, result: dict) -> str:
    """`eval  step N  loss X  perplexity Y  tokens T`, aligned with the step lines."""
    acceptance = "".join(
        f"  mtp depth {key[len(EVAL_MTP_ACCEPTANCE) :]} acceptance {value * 100:.1f}%"
        for key, value in result.items()
        if key.startswith(EVAL_MTP_ACCEPTANCE)
    )
    return (
        f"eval  step {step:5d}  loss {result['eval_loss']:.4f}  "
        f"perplexity {result['eval_perplexity']:.2f}  tokens {result['eval_tokens']:,}"
        f"{acceptance}  {result['eval_time_s'] * 1000:.0f} ms"
    )
