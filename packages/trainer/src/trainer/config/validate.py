"""Checks that need the machine (device count) — all run before anything compiles.

`validate` takes the whole Config: its checks cross groups (a batch size against the
mesh, a schedule against the model); each helper takes only the groups it reads.

A rule a library owns is checked by that library, not restated here: the routing keys
by moe_kernels when moe_map builds its MoEConfig (named by the trainer's keys), the
reduction policy and the accumulation schedule by accum when the run's plan is made
(trainer.sharding.reduction_plan, from trainer.run.spec.resolve: before anything is
built).
"""

from __future__ import annotations

import math

import moe_kernels
from trainer.config import lora_targets, moe_map
from trainer.config.config import Config
from trainer.config.keys import DTYPES, ROPE_TYPES, ConfigError
from trainer.config.layer_loop import SCAN_SCHEDULES
from trainer.config.mesh_shape import expert_keys, mesh_shape
from trainer.config.model_keys import ModelConfig
from trainer.config.pipeline import check_pipeline, pipeline_microbatches
from trainer.config.run_keys import (
    LR_SCHEDULERS,
    AccumulationConfig,
    DataConfig,
    EvaluationConfig,
    ParallelismConfig,
    TrainingConfig,
)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def batch_shard_count(parallelism: ParallelismConfig, sizes: dict[str, int]) -> int:
    """How many ways the batch dimension is split (dcn x data x fsdp x expert-as-fsdp)."""
    count = sizes["dcn_data"] * sizes["dcn_fsdp"] * sizes["data"] * sizes["fsdp"]
    if parallelism.expert_shard_attention_option == "fsdp":
        count *= sizes["expert"]
    return count


def microbatch_size(data: DataConfig, num_devices: int) -> int:
    """Sequences per microbatch: per_device_batch_size x devices (MaxText's meaning).

    Must come out a whole number.
    """
    total = data.per_device_batch_size * num_devices
    _require(
        total >= 1 and total == int(total),
        f"per_device_batch_size={data.per_device_batch_size} x {num_devices} devices = "
        f"{total} is not a whole, positive number of sequences per microbatch",
    )
    return int(total)


def global_batch_size(accumulation: AccumulationConfig, data: DataConfig, num_devices: int) -> int:
    """Sequences per optimizer step: per_device_batch_size x devices x
    gradient_accumulation_steps, as in MaxText (each microbatch holds
    per_device_batch_size sequences per device)."""
    return microbatch_size(data, num_devices) * accumulation.gradient_accumulation_steps


def validate(config: Config, num_devices: int, num_slices: int | None = None) -> dict[str, int]:
    """Raise ConfigError naming the key for anything that would fail later; return mesh sizes.

    `num_slices`: the slices the devices form (default: config.num_slices, or 1).
    Not here: the reduction policy and the schedule against the mesh, accum's rules,
    refused where the plan is made (`trainer.run.spec.resolve`; plan-reduction too).

    >>> from trainer.config import make_config
    >>> from trainer.config.validate import global_batch_size, validate
    >>> config = make_config({"ici_fsdp_parallelism": "4", "per_device_batch_size": "2"})
    >>> sizes = validate(config, num_devices=8)  # the data axis (-1) fills the rest
    >>> sizes["data"], sizes["fsdp"], global_batch_size(config.accumulation, config.data, 8)
    (2, 4, 16)
    >>> validate(make_config({"ici_fsdp_parallelism": "8", "per_device_batch_size": "0.25"}), 8)
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: microbatch of 2 sequences (...) does not split over 8 batch ...
    """
    if num_slices is None:
        num_slices = config.num_slices if config.num_slices > 0 else 1
    sizes = mesh_shape(config.parallelism, num_devices, num_slices)
    _check_training(config)
    _check_model(config)
    model, parallelism, data = config.model, config.parallelism, config.data
    _check_parallelism(model, parallelism, data, sizes)
    _check_accumulation_schedule(model, config.accumulation)
    check_pipeline(config, sizes)
    microbatch = microbatch_size(data, num_devices)
    if config.gradient_accumulation_steps == 1:
        # One accumulation microbatch that the pipeline splits further.
        microbatch //= pipeline_microbatches(parallelism, config.accumulation)
    shards = batch_shard_count(parallelism, sizes)
    _require(
        microbatch % shards == 0,
        f"microbatch of {microbatch} sequences (per_device_batch_size="
        f"{config.per_device_batch_size} x {num_devices} devices) does not split over "
        f"{shards} batch shards "
        f"(dcn_data x dcn_fsdp x data x fsdp"
        f"{' x expert' if config.expert_shard_attention_option == 'fsdp' else ''})",
    )
    return sizes


def _check_training(config: Config) -> None:
    _require(config.steps >= 1, f"steps={config.steps} must be >= 1")
    _require(
        config.gradient_accumulation_steps >= 1,
        f"gradient_accumulation_steps={config.gradient_accumulation_steps} must be >= 1",
    )
    _require(config.learning_rate > 0, f"learning_rate={config.learning_rate} must be > 0")
    _require(
        0 <= config.warmup_steps_fraction <= 1,
        f"warmup_steps_fraction={config.warmup_steps_fraction} must be in [0, 1]",
    )
    _require(
        -1 <= config.warmup_steps <= config.steps,
        f"warmup_steps={config.warmup_steps} must be <= steps={config.steps} (-1: the fraction)",
    )
    _require(
        config.num_epochs >= 0 and not (config.num_epochs and config.dataset_type == "synthetic"),
        f"num_epochs={config.num_epochs} must be >= 0 and needs data of known size "
        "(dataset_type text or hf), not synthetic batches",
    )
    _require(
        config.lr_scheduler_type in LR_SCHEDULERS,
        f"lr_scheduler_type={config.lr_scheduler_type!r} is not one of cosine, linear, constant "
        "(transformers' names; constant keeps the warmup, as its constant_with_warmup; "
        "cosine ends at cosine_final_lr_fraction, 0 for transformers' cosine)",
    )
    _require(config.log_period >= 1, f"log_period={config.log_period} must be >= 1")
    # make_config parses these; a Config edited with dataclasses.replace is checked here.
    for key in ("dtype", "weight_dtype", "accum_dtype"):
        value = getattr(config, key)
        _require(value in DTYPES, f"{key}={value!r} is not one of {DTYPES}")
    _require(
        config.gradient_clipping_threshold >= 0,
        f"gradient_clipping_threshold={config.gradient_clipping_threshold} must be >= 0",
    )
    _check_moment_dtypes(config.training, config.weight_dtype)


# 1 - beta below this: a bf16 moment's decay rounds away (tests/test_adam_moments.py
# checks the threshold over every positive normal bf16 value).
MIN_BF16_DECAY = 2.0**-8


def _check_moment_dtypes(training: TrainingConfig, weight_dtype: str) -> None:
    """AdamW's moment dtypes: one of the dtype names, and bf16 (asked for, or the
    weights' through '') only where its decay shows.

    Refused rather than computed some other way: the moment is computed in float32
    already (step/adam_moments.py); it is the rounding of beta x m back to bf16 that
    returns m when 1 - beta is under half a bf16 spacing, at any precision of the
    product, so only a wider storage dtype (or stochastic rounding) keeps the decay.
    """
    for key, beta_key in (("mu_dtype", "adam_b1"), ("nu_dtype", "adam_b2")):
        value, beta = getattr(training, key), getattr(training, beta_key)
        _require(value in ("", *DTYPES), f"{key}={value!r} is not one of {('', *DTYPES)}")
        stored = f"{key}=bfloat16" if value else f"{key}='' with weight_dtype=bfloat16"
        _require(
            (value or weight_dtype) != "bfloat16" or 1 - beta >= MIN_BF16_DECAY,
            f"{stored} and {beta_key}={beta}: 1 - {beta_key} = {1 - beta:.2g} is under 2^-8 "
            f"({MIN_BF16_DECAY:.2g}), half a bf16 spacing, so {beta_key} x moment rounds "
            f"back to the moment in bf16 and it never decays; use {key}=float32 or "
            f"{beta_key} <= {1 - MIN_BF16_DECAY}",
        )


def _check_model(config: Config) -> None:
    _require(
        0 <= config.first_num_dense_layers <= config.base_num_decoder_layers,
        f"first_num_dense_layers={config.first_num_dense_layers} must be between 0 and "
        f"base_num_decoder_layers={config.base_num_decoder_layers}",
    )
    for key in ("vocab_size", "base_emb_dim", "base_num_decoder_layers", "max_target_length"):
        _require(getattr(config, key) >= 1, f"{key}={getattr(config, key)} must be >= 1")
    _require(
        config.qk_rope_head_dim % 2 == 0,
        f"qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)",
    )
    check_architecture(config.model, config.data)
    lora_targets.check(config.model)
    if config.num_moe_layers:
        _check_moe(config.model)
    _check_mtp(config.model, config.data, config.evaluation)


def _check_mtp(model: ModelConfig, data: DataConfig, evaluation: EvaluationConfig) -> None:
    depth, length = model.mtp_num_layers, data.max_target_length
    _require(depth >= 0, f"mtp_num_layers={depth} must be >= 0 (0 = no multi-token prediction)")
    # Depth k predicts the token k+1 ahead: position i needs i + k < length.
    _require(
        depth < length,
        f"mtp_num_layers={depth} leaves no target token at max_target_length={length} "
        f"(depth k predicts k+1 tokens ahead); use at most {length - 1}",
    )
    _require(
        model.mtp_loss_scaling_factor >= 0,
        f"mtp_loss_scaling_factor={model.mtp_loss_scaling_factor} must be >= 0",
    )
    target = evaluation.mtp_eval_target_module
    _require(
        0 <= target <= depth,
        f"mtp_eval_target_module={target} must be between 0 (off) and mtp_num_layers={depth}",
    )


def check_architecture(model: ModelConfig, data: DataConfig) -> None:
    """ConfigError naming the key for a bad attention/RoPE option (no machine needed)."""
    _require(
        model.q_lora_rank >= 0,
        f"q_lora_rank={model.q_lora_rank} must be >= 0 (0 = a plain query projection)",
    )
    _require(
        model.rope_type in ROPE_TYPES, f"rope_type={model.rope_type!r} is not one of {ROPE_TYPES}"
    )
    if model.rope_type != "yarn":
        return
    _require(
        model.rope_factor > 1,
        f"rope_factor={model.rope_factor} must be > 1 with rope_type=yarn (it stretches "
        "the original context; use rope_type=default for plain RoPE)",
    )
    _require(
        model.original_max_position_embeddings >= 1,
        f"original_max_position_embeddings={model.original_max_position_embeddings} must be >= 1",
    )
    _require(model.beta_slow > 0, f"beta_slow={model.beta_slow} must be > 0")
    _require(
        model.beta_fast >= model.beta_slow,
        f"beta_fast={model.beta_fast} must be >= beta_slow={model.beta_slow}",
    )
    _require(model.mscale >= 0, f"mscale={model.mscale} must be >= 0")
    _require(
        data.max_target_length <= model.max_position_embeddings,
        f"max_target_length={data.max_target_length} exceeds max_position_embeddings="
        f"{model.max_position_embeddings}, the context rope_type=yarn extends to",
    )


def _check_moe(model: ModelConfig) -> None:
    # The routing keys are moe_kernels' rules (moe_map.check names the keys); the
    # z-loss is the trainer's own.
    moe_map.check(model)
    _require(
        model.moe_z_loss_coeff >= 0,
        f"moe_z_loss_coeff={model.moe_z_loss_coeff} must be >= 0 (0 = no router z-loss)",
    )


def _check_expert_count(model: ModelConfig, parallelism: ParallelismConfig, expert: int) -> None:
    """Experts must split evenly over the expert axis, its cross-slice part included
    (and into the routing groups): refused with the nearest counts that do."""
    if model.num_experts % expert == 0:
        return
    # Multiples of both the axis and the routing groups, so the suggestion is valid.
    step = math.lcm(expert, model.n_routing_groups)
    fits = ", ".join(map(str, moe_kernels.fitting_expert_counts(model.num_experts, step)))
    raise ConfigError(
        f"num_experts={model.num_experts} is not divisible by {expert_keys(parallelism)}="
        f"{expert} (the expert axis shards the experts evenly); nearest that fit: {fits}"
    )


def _check_accumulation_schedule(model: ModelConfig, accumulation: AccumulationConfig) -> None:
    # fused (the default) has no effect without the scan; an overlapped schedule is
    # asked for explicitly and would silently not overlap. The schedule against the
    # plan (overlapped_ring's shard mode and policy) is accum.check_schedule's rule,
    # checked where the plan is made (trainer.sharding.reduction_plan).
    schedule = accumulation.gradient_accumulation_schedule
    key = f"gradient_accumulation_schedule={schedule}"
    _require(
        # auto scans for these schedules (config/layer_loop.py).
        schedule not in SCAN_SCHEDULES or model.scan_layers is not False,
        f"{key} needs scan_layers=true (it works inside the backward layer scan)",
    )
    _require(
        schedule not in SCAN_SCHEDULES or not model.lora_rank,
        f"{key} does not run with lora_rank={model.lora_rank}: LoRA's step differentiates "
        "the small adapters only, without the fused layer backward the overlapped schedules "
        "need; use plain or fused (which runs as plain with LoRA)",
    )


def _check_parallelism(
    model: ModelConfig, parallelism: ParallelismConfig, data: DataConfig, sizes: dict[str, int]
) -> None:
    if parallelism.shard_optimizer_over_data:
        for key, axis in (("ici_fsdp_parallelism", "fsdp"), ("dcn_fsdp_parallelism", "dcn_fsdp")):
            _require(
                sizes[axis] == 1,
                f"shard_optimizer_over_data=true (ZeRO-1) cannot be combined with "
                f"{key}={sizes[axis]} (FSDP already shards the optimizer state)",
            )
    _check_expert_count(model, parallelism, sizes["expert"])
    _require(
        model.base_num_query_heads % sizes["tensor"] == 0,
        f"base_num_query_heads={model.base_num_query_heads} is not divisible by "
        f"ici_tensor_parallelism={sizes['tensor']}",
    )
    seq_shards = sizes["context"] * (
        sizes["expert"] if parallelism.expert_shard_attention_option == "context" else 1
    )
    _require(
        data.max_target_length % seq_shards == 0,
        f"max_target_length={data.max_target_length} is not divisible by the {seq_shards} "
        "sequence shards (ici_context_parallelism"
        + (
            f" x {expert_keys(parallelism)}"
            if parallelism.expert_shard_attention_option == "context"
            else ""
        )
        + ")",
    )
    for key, dim, axis in (
        ("base_emb_dim", model.base_emb_dim, "tensor_transpose"),
        ("base_mlp_dim", model.base_mlp_dim, "tensor"),
        ("base_moe_mlp_dim", model.base_moe_mlp_dim, "tensor"),
    ):
        _require(
            dim % sizes[axis] == 0,
            f"{key}={dim} is not divisible by ici_{axis}_parallelism={sizes[axis]}",
        )
