"""Checks that need the machine (device count) — all run before anything compiles."""

from __future__ import annotations

from moe_kernels.config import TOPK_METHODS
from trainer.config import DTYPES, ROPE_TYPES, Config, ConfigError, mesh_shape


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def batch_shard_count(config: Config, sizes: dict[str, int]) -> int:
    """How many ways the batch dimension is split (dcn x data x fsdp x expert-as-fsdp)."""
    count = sizes["dcn_data"] * sizes["dcn_fsdp"] * sizes["data"] * sizes["fsdp"]
    if config.expert_shard_attention_option == "fsdp":
        count *= sizes["expert"]
    return count


def microbatch_size(config: Config, num_devices: int) -> int:
    """Sequences per microbatch: per_device_batch_size x devices (MaxText's meaning).

    Must come out a whole number.
    """
    total = config.per_device_batch_size * num_devices
    _require(
        total >= 1 and total == int(total),
        f"per_device_batch_size={config.per_device_batch_size} x {num_devices} devices = "
        f"{total} is not a whole, positive number of sequences per microbatch",
    )
    return int(total)


def global_batch_size(config: Config, num_devices: int) -> int:
    """Sequences per optimizer step: per_device_batch_size x devices x
    gradient_accumulation_steps, as in MaxText (each microbatch holds
    per_device_batch_size sequences per device)."""
    return microbatch_size(config, num_devices) * config.gradient_accumulation_steps


def validate(config: Config, num_devices: int, num_slices: int | None = None) -> dict[str, int]:
    """Raise ConfigError naming the key for anything that would fail later; return mesh sizes.

    `num_slices`: the slices the devices form (default: config.num_slices, or 1).

    >>> from trainer.config import make_config
    >>> from trainer.validate import global_batch_size, validate
    >>> config = make_config({"ici_fsdp_parallelism": "4", "per_device_batch_size": "2"})
    >>> sizes = validate(config, num_devices=8)  # the data axis (-1) fills the rest
    >>> sizes["data"], sizes["fsdp"], global_batch_size(config, 8)
    (2, 4, 16)
    >>> validate(make_config({"ici_fsdp_parallelism": "8", "per_device_batch_size": "0.25"}), 8)
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: microbatch of 2 sequences (...) does not split over 8 batch ...
    """
    if num_slices is None:
        num_slices = config.num_slices if config.num_slices > 0 else 1
    sizes = mesh_shape(config, num_devices, num_slices)
    _check_training(config)
    _check_model(config)
    _check_parallelism(config, sizes)
    _check_reduction_policy(config, sizes)
    _check_accumulation_schedule(config)
    microbatch = microbatch_size(config, num_devices)
    shards = batch_shard_count(config, sizes)
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
    _require(config.log_period >= 1, f"log_period={config.log_period} must be >= 1")
    # make_config parses these; a Config edited with dataclasses.replace is checked here.
    for key in ("dtype", "weight_dtype", "accum_dtype"):
        value = getattr(config, key)
        _require(value in DTYPES, f"{key}={value!r} is not one of {DTYPES}")
    _require(
        config.gradient_clipping_threshold >= 0,
        f"gradient_clipping_threshold={config.gradient_clipping_threshold} must be >= 0",
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
    check_architecture(config)
    if config.num_moe_layers:
        _check_routing(config)
    _check_mtp(config)


def _check_mtp(config: Config) -> None:
    depth, length = config.mtp_num_layers, config.max_target_length
    _require(depth >= 0, f"mtp_num_layers={depth} must be >= 0 (0 = no multi-token prediction)")
    # Depth k predicts the token k+1 ahead: position i needs i + k < length.
    _require(
        depth < length,
        f"mtp_num_layers={depth} leaves no target token at max_target_length={length} "
        f"(depth k predicts k+1 tokens ahead); use at most {length - 1}",
    )
    _require(
        config.mtp_loss_scaling_factor >= 0,
        f"mtp_loss_scaling_factor={config.mtp_loss_scaling_factor} must be >= 0",
    )
    target = config.mtp_eval_target_module
    _require(
        0 <= target <= depth,
        f"mtp_eval_target_module={target} must be between 0 (off) and mtp_num_layers={depth}",
    )


def check_architecture(config: Config) -> None:
    """ConfigError naming the key for a bad attention/RoPE option (no machine needed)."""
    _require(
        config.q_lora_rank >= 0,
        f"q_lora_rank={config.q_lora_rank} must be >= 0 (0 = a plain query projection)",
    )
    for key, choices in (("rope_type", ROPE_TYPES), ("routed_topk_method", TOPK_METHODS)):
        value = getattr(config, key)
        _require(value in choices, f"{key}={value!r} is not one of {choices}")
    if config.rope_type != "yarn":
        return
    _require(
        config.rope_factor > 1,
        f"rope_factor={config.rope_factor} must be > 1 with rope_type=yarn (it stretches "
        "the original context; use rope_type=default for plain RoPE)",
    )
    _require(
        config.original_max_position_embeddings >= 1,
        f"original_max_position_embeddings={config.original_max_position_embeddings} must be >= 1",
    )
    _require(config.beta_slow > 0, f"beta_slow={config.beta_slow} must be > 0")
    _require(
        config.beta_fast >= config.beta_slow,
        f"beta_fast={config.beta_fast} must be >= beta_slow={config.beta_slow}",
    )
    _require(config.mscale >= 0, f"mscale={config.mscale} must be >= 0")
    _require(
        config.max_target_length <= config.max_position_embeddings,
        f"max_target_length={config.max_target_length} exceeds max_position_embeddings="
        f"{config.max_position_embeddings}, the context rope_type=yarn extends to",
    )


def _check_routing(config: Config) -> None:
    experts, k = config.num_experts, config.num_experts_per_tok
    _require(experts >= 1, f"num_experts={experts} must be >= 1")
    _require(
        config.capacity_factor >= 0,
        f"capacity_factor={config.capacity_factor} must be >= 0 (0 = no token dropped)",
    )
    _require(
        1 <= k <= experts, f"num_experts_per_tok={k} must be between 1 and num_experts={experts}"
    )
    groups, top_groups = config.n_routing_groups, config.topk_routing_group
    _require(
        config.routed_topk_method != "greedy" or groups == 1,
        f"routed_topk_method=greedy picks over all experts: n_routing_groups={groups} "
        "must be 1 (or use noaux_tc / group_limited_greedy)",
    )
    _require(
        groups >= 1 and experts % groups == 0,
        f"n_routing_groups={groups} must divide num_experts={experts}",
    )
    _require(
        1 <= top_groups <= groups,
        f"topk_routing_group={top_groups} must be between 1 and n_routing_groups={groups}",
    )
    _require(
        k <= top_groups * (experts // groups),
        f"num_experts_per_tok={k} exceeds the {top_groups * (experts // groups)} experts in "
        f"topk_routing_group={top_groups} groups of {experts // groups}",
    )


def _check_accumulation_schedule(config: Config) -> None:
    # fused (the default) has no effect without the scan; an overlapped schedule is
    # asked for explicitly and would silently not overlap.
    schedule = config.gradient_accumulation_schedule
    key = f"gradient_accumulation_schedule={schedule}"
    _require(
        schedule not in ("overlapped", "overlapped_ring") or config.scan_layers,
        f"{key} needs scan_layers=true (it works inside the backward layer scan)",
    )
    if schedule != "overlapped_ring":
        return
    _require(
        config.shard_mode == "explicit",
        f"{key} needs shard_mode=explicit (auto mode lets XLA place every reduction)",
    )
    _require(
        config.gradient_reduction_policy != "per_microbatch",
        f"{key} does nothing with gradient_reduction_policy=per_microbatch (every gradient "
        "is reduced in its microbatch's backward): use gradient_accumulation_schedule="
        "overlapped",
    )


def _check_reduction_policy(config: Config, sizes: dict[str, int]) -> None:
    policy = config.gradient_reduction_policy
    if policy != "hierarchical":
        return
    _require(
        config.shard_mode == "explicit",
        "gradient_reduction_policy=hierarchical needs shard_mode=explicit (auto mode lets XLA "
        "place every reduction)",
    )
    _require(
        sizes["dcn_data"] * sizes["dcn_fsdp"] > 1,
        "gradient_reduction_policy=hierarchical needs a cross-slice axis: "
        "dcn_data_parallelism > 1 (with num_slices, or compile_topology_num_slices, > 1); "
        "this mesh has one slice",
    )


def _check_parallelism(config: Config, sizes: dict[str, int]) -> None:
    if config.shard_optimizer_over_data:
        for key, axis in (("ici_fsdp_parallelism", "fsdp"), ("dcn_fsdp_parallelism", "dcn_fsdp")):
            _require(
                sizes[axis] == 1,
                f"shard_optimizer_over_data=true (ZeRO-1) cannot be combined with "
                f"{key}={sizes[axis]} (FSDP already shards the optimizer state)",
            )
    _require(
        config.num_experts % sizes["expert"] == 0,
        f"num_experts={config.num_experts} is not divisible by "
        f"ici_expert_parallelism={sizes['expert']}",
    )
    _require(
        config.base_num_query_heads % sizes["tensor"] == 0,
        f"base_num_query_heads={config.base_num_query_heads} is not divisible by "
        f"ici_tensor_parallelism={sizes['tensor']}",
    )
    seq_shards = sizes["context"] * (
        sizes["expert"] if config.expert_shard_attention_option == "context" else 1
    )
    _require(
        config.max_target_length % seq_shards == 0,
        f"max_target_length={config.max_target_length} is not divisible by the {seq_shards} "
        "sequence shards (ici_context_parallelism"
        + (" x ici_expert_parallelism" if config.expert_shard_attention_option == "context" else "")
        + ")",
    )
    for key, dim, axis in (
        ("base_emb_dim", config.base_emb_dim, "tensor_transpose"),
        ("base_mlp_dim", config.base_mlp_dim, "tensor"),
        ("base_moe_mlp_dim", config.base_moe_mlp_dim, "tensor"),
    ):
        _require(
            dim % sizes[axis] == 0,
            f"{key}={dim} is not divisible by ici_{axis}_parallelism={sizes[axis]}",
        )
