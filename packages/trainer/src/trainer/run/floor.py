"""The floor: a data-parallel step written by hand in one `jax.shard_map`.

The reference issue 9 measures the explicit-sharding path against. Every
device runs the same model on its own rows with no sharding annotations at all
(a `ShardCtx` in 'manual' mode), sums its microbatch gradients in a `lax.scan`,
and a single `psum` over 'data' after the loop reduces the gradients, the loss
sums and the router token counts together: the least collective traffic a
data-parallel step can have. The optimizer update then runs replicated, as in
the trainer's data layout.

Only a pure data-parallel layout has this floor: every mesh axis but 'data' of
size one and no ZeRO-1 (`check_floor_layout` says which setting is off).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import accum
import pspec_tags as pt
from trainer import model as model_lib
from trainer.config import Config, ModelConfig, ParallelismConfig
from trainer.run import run as run_lib
from trainer.run.spec import resolve
from trainer.sharding import ShardCtx
from trainer.step.optimizer import make_optimizer
from trainer.step.train_step import StepFns, apply_gradients, make_loss_fn

AXIS = "data"


def check_floor_layout(
    model: ModelConfig, parallelism: ParallelismConfig, mesh_sizes: dict[str, int]
) -> None:
    """ValueError naming the setting that makes the layout more than data parallel."""
    others = {a: n for a, n in mesh_sizes.items() if a != AXIS and n > 1}
    if others:
        names = ", ".join(f"ici_{a}_parallelism={n}" for a, n in sorted(others.items()))
        raise ValueError(f"the floor step is pure data parallel; this mesh also has {names}")
    if parallelism.shard_optimizer_over_data:
        raise ValueError("the floor step keeps the optimizer replicated: set "
                         "shard_optimizer_over_data=false")  # fmt: skip
    if model.lora_rank:
        raise ValueError("the floor step trains every parameter: set lora_rank=0")
    if model.mtp_num_layers:
        # Its MTP loss weights need the whole batch's target counts (a collective
        # before the per-device loop); the floor is the plain model's yardstick.
        raise ValueError("the floor step has no multi-token prediction: set mtp_num_layers=0")


def _sum_dtype(dtype):
    return jnp.float32 if dtype == jnp.bfloat16 else dtype


def make_floor_step(config: Config, ctx: ShardCtx, tx: optax.GradientTransformation) -> StepFns:
    """`step(state, batch)` with the trainer's contract, as one manual shard_map.

    Takes the Config: `model.define` builds the model from the whole of it."""
    check_floor_layout(config.model, config.parallelism, dict(ctx.mesh.shape))
    # The model built for per-device code: no constraints, no out_shardings, the
    # MoE layer unsharded (its own shard_map cannot nest inside this one).
    model_def = model_lib.define(config.model, dataclasses.replace(ctx, mode="manual"))
    model, training, accumulation = config.model, config.training, config.accumulation

    def local_sums(state: dict, rows: dict) -> tuple[Any, dict, Any]:
        """This device's loss sum, aux sums and gradient sums over its microbatches."""
        loss_fn = make_loss_fn(model, model_def, state["router"])
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        microbatches = accum.split_microbatches(rows, accumulation.gradient_accumulation_steps)
        first = jax.tree.map(lambda x: x[0], microbatches)
        # Differentiate with respect to a varying copy of the (replicated)
        # parameters: the gradient of an invariant value is psummed on the spot
        # (the transpose of the implicit invariant-to-varying cast), which would
        # put an all-reduce in every microbatch. A varying copy keeps each
        # device's gradient local until the psum after the loop.
        params = jax.tree.map(lambda p: pt.to_varying(p, AXIS), state["params"])

        # The sums differ per device (each sees its own rows): the scan carry
        # must be typed varying over 'data' from the start.
        zeros = jax.tree.map(
            lambda s: pt.to_varying(jnp.zeros(s.shape, _sum_dtype(s.dtype)), AXIS),
            jax.eval_shape(grad_fn, params, first),
        )

        def body(sums, microbatch):
            out = grad_fn(params, microbatch)
            return jax.tree.map(lambda s, x: s + x.astype(s.dtype), sums, out), None

        ((loss_sum, aux), grads), _ = lax.scan(body, zeros, microbatches)
        return loss_sum, aux, grads

    def per_device(state: dict, rows: dict) -> tuple[dict, dict]:
        loss_sum, aux, grads = local_sums(state, rows)
        # The one collective of the step: every partial sum reduced together.
        loss_sum, aux, grads = lax.psum((loss_sum, aux, grads), AXIS)
        weight = jnp.maximum(aux["weight"], 1.0)
        grads = jax.tree.map(lambda g: g / weight, grads)
        return apply_gradients(model, training, tx, state, loss_sum / weight, aux, grads)

    # Batch rows are split over 'data'; everything else is replicated.
    batch_spec = ctx.spec(("activation_batch", "activation_length"))

    def step(state: dict, batch: dict) -> tuple[dict, dict]:
        # TAG: no tags by design: every axis is manual, and the body's one psum
        # after the scan is the step's only reduction.
        return jax.shard_map(
            per_device,
            mesh=ctx.mesh,
            in_specs=(P(), batch_spec),
            out_specs=(P(), P()),
        )(state, batch)

    return StepFns(init_opt_state=tx.init, step=step)


def setup_floor(config: Config, devices: list | None = None):
    """`run.setup`, with the run's step replaced by the floor step (same state, data, loop)."""
    spec = resolve(config, devices if devices is not None else jax.devices())
    # Before anything is built or allocated.
    check_floor_layout(config.model, config.parallelism, spec.mesh_shape)
    run = run_lib.start(spec)
    fns = make_floor_step(config, run.ctx, make_optimizer(config.training))
    run.step_fn = run_lib.jit_step(fns.step, run.state)
    return run
