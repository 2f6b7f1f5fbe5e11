"""Config: presets, overrides, and a table of bad configurations caught before compiling."""

import dataclasses

import jax
import pytest

from trainer.config import (
    OTHER_DCN_KEYS,
    PRESETS,
    Config,
    ConfigError,
    make_config,
    mesh_shape,
    parse_overrides,
)
from trainer.config.validate import validate
from trainer.run.spec import resolve
from trainer.run.xla_options import (
    TPU_ASYNC_COLLECTIVES,
    compiler_options,
    for_mesh,
    platform_of,
)

BAD = [
    (
        {"per_device_batch_sise": "2"},
        "unknown config key 'per_device_batch_sise'.*did you mean 'per_device_batch_size'",
    ),
    ({"steps": "ten"}, r"steps='ten' is not an integer"),
    ({"steps": "2.5"}, r"steps='2.5' is not an integer"),
    ({"learning_rate": "fast"}, r"learning_rate='fast' is not a number"),
    ({"scan_layers": "maybe"}, r"scan_layers='maybe' is not true, false or auto"),
    ({"shard_mode": "manual"}, r"shard_mode='manual' is not one of \('explicit', 'auto'\)"),
    ({"model_name": "deepseek4"}, r"model_name='deepseek4' is not one of"),
    (
        {"ici_data_parallelism": "3"},
        r"ici_\*_parallelism keys multiply to 3 \(ici_data_parallelism=3\) but there are 8 "
        r"devices: change them so their product is 8, or set one of them to -1",
    ),
    (
        {"ici_data_parallelism": "-1", "ici_fsdp_parallelism": "-1"},
        r"only one ici_\*_parallelism may be -1",
    ),
    ({"ici_fsdp_parallelism": "3"}, r"ici_data_parallelism=-1 cannot fill 8 devices.*3"),
    ({"ici_tensor_parallelism": "0"}, r"ici_tensor_parallelism=0 must be a positive size or -1"),
    (
        {"per_device_batch_size": "0.5"},
        r"microbatch of 4 sequences \(per_device_batch_size=0.5 x 8 devices\) does not split "
        r"over 8 batch shards",
    ),
    (
        {"per_device_batch_size": "0.3"},
        r"per_device_batch_size=0.3 x 8 devices = 2.4 is not a whole",
    ),
    (
        {"shard_optimizer_over_data": "true", "ici_fsdp_parallelism": "2"},
        r"shard_optimizer_over_data=true \(ZeRO-1\) cannot be combined with ici_fsdp_parallelism=2",
    ),
    (
        {"num_experts": "6", "n_routing_groups": "3", "ici_expert_parallelism": "4"},
        r"num_experts=6 is not divisible by ici_expert_parallelism=4",
    ),
    # The expert axis' cross-slice part counts: 2 x 2 = 4 does not divide 6 experts.
    (
        {
            "num_experts": "6",
            "n_routing_groups": "3",
            "num_slices": "2",
            "dcn_data_parallelism": "1",
            "dcn_expert_parallelism": "2",
            "ici_expert_parallelism": "2",
        },
        r"^num_experts=6 is not divisible by dcn_expert_parallelism x ici_expert_parallelism=4 ",
    ),
    # The routing rules are moe_kernels' (its reason), named by the trainer's keys.
    (
        {"num_experts_per_tok": "9"},
        r"^num_experts_per_tok \(top_k\)=9 must be between 1 and num_experts=8$",
    ),
    (
        {"n_routing_groups": "3"},
        r"^n_routing_groups=3 \(moe_kernels' n_groups\): n_groups=3 does not divide "
        r"num_experts=8 into equal groups$",
    ),
    (
        {"topk_routing_group": "3"},
        r"^topk_routing_group=3, n_routing_groups=2 \(moe_kernels' topk_groups, n_groups\): "
        r"topk_groups=3 must be between 1 and n_groups=2$",
    ),
    (
        {"num_experts_per_tok": "5", "topk_routing_group": "1"},
        r"^topk_routing_group=1 \(moe_kernels' topk_groups\): num_experts_per_tok=5 exceeds "
        r"the 4 experts",
    ),
    ({"num_experts": "0"}, r"^num_experts=0 must be at least 1$"),
    (
        {"base_moe_mlp_dim": "0"},
        r"^base_moe_mlp_dim=0 \(moe_kernels' mlp_dim\): mlp_dim=0 must be positive$",
    ),
    (
        {"ici_tensor_parallelism": "8", "base_num_query_heads": "4"},
        r"base_num_query_heads=4 is not divisible by ici_tensor_parallelism=8",
    ),
    (
        {"ici_context_parallelism": "8", "max_target_length": "20"},
        r"max_target_length=20 is not divisible by the 8 sequence shards",
    ),
    (
        {"first_num_dense_layers": "5"},
        r"first_num_dense_layers=5 must be between 0 and base_num_decoder_layers=3",
    ),
    ({"qk_rope_head_dim": "7"}, r"qk_rope_head_dim=7 must be even"),
    ({"steps": "0"}, r"steps=0 must be >= 1"),
    ({"capacity_factor": "-1"}, r"^capacity_factor=-1.0 must be >= 0"),
    ({"learning_rate": "-1"}, r"learning_rate=-1.0 must be > 0"),
    (
        {"dcn_tensor_parallelism": "2"},
        r"^dcn_tensor_parallelism=2 is not supported: only dcn_data_parallelism, "
        r"dcn_fsdp_parallelism, dcn_pipeline_parallelism and dcn_expert_parallelism cross "
        r"slices here "
        r"\(.*per-layer collectives on DCN\)",
    ),
    (
        {"accum_dtype": "float16"},
        r"^accum_dtype='float16' is not one of \('float32', 'bfloat16'\)$",
    ),
    (
        {"gradient_accumulation_schedule": "overlapped", "scan_layers": "false"},
        r"^gradient_accumulation_schedule=overlapped needs scan_layers=true",
    ),
    (
        {"gradient_accumulation_schedule": "ring"},
        r"^gradient_accumulation_schedule='ring' is not one of \('plain', 'fused', "
        r"'overlapped', 'overlapped_ring'\)$",
    ),
    # The removed keys: one line saying what to write instead.
    (
        {"fused_gradient_accumulation": "false"},
        r"^fused_gradient_accumulation removed: write gradient_accumulation_schedule=plain "
        r"instead$",
    ),
    (
        {"overlap_gradient_reduction": "true"},
        r"^overlap_gradient_reduction removed: write gradient_accumulation_schedule=overlapped "
        r"instead$",
    ),
    (
        {"overlap_gradient_reduction": "true", "ring_reduce_scatter": "true"},
        r"^overlap_gradient_reduction, ring_reduce_scatter removed: write "
        r"gradient_accumulation_schedule=overlapped_ring instead$",
    ),
    (
        {"defer_gradient_reduction": "false", "fused_gradient_accumulation": "true"},
        r"^defer_gradient_reduction, fused_gradient_accumulation removed: write "
        r"gradient_accumulation_schedule=fused gradient_reduction_policy=per_microbatch instead$",
    ),
    (
        {"defer_gradient_reduction": "maybe"},
        r"^defer_gradient_reduction='maybe' is not a boolean",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[",".join(o) for o, _ in BAD])
def test_bad_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(overrides), 8)


# Refused where the plan is made (accum's rules: run.spec.resolve), before building.
BAD_PLANS = [
    (
        {"gradient_accumulation_schedule": "overlapped_ring", "shard_mode": "auto"},
        r"^gradient_accumulation_schedule=overlapped_ring with shard_mode=auto, "
        r"gradient_reduction_policy=deferred: schedule='overlapped_ring' needs explicit mode "
        r"\(mode='auto' lets XLA place every reduction\); use schedule='overlapped'$",
    ),
    (
        {
            "gradient_accumulation_schedule": "overlapped_ring",
            "gradient_reduction_policy": "per_microbatch",
        },
        r"^gradient_accumulation_schedule=overlapped_ring with shard_mode=explicit, "
        r"gradient_reduction_policy=per_microbatch: schedule='overlapped_ring' does nothing "
        r"under policy='per_microbatch' .*; use schedule='overlapped'$",
    ),
]


@pytest.mark.parametrize(
    "overrides,message", BAD_PLANS, ids=[",".join(o.values()) for o, _ in BAD_PLANS]
)
def test_a_schedule_accum_refuses_names_the_key_before_building(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve(make_config(overrides), jax.devices())


def test_schedule_values_are_accums_and_fused_is_the_default():
    import typing

    import accum

    hint = typing.get_type_hints(Config)["gradient_accumulation_schedule"]
    assert typing.get_args(hint) == accum.SCHEDULES
    assert make_config().gradient_accumulation_schedule == "fused"


def test_accum_dtype_defaults_to_float32_and_takes_bfloat16():
    assert make_config().accum_dtype == "float32"
    assert make_config({"accum_dtype": "bfloat16"}).accum_dtype == "bfloat16"
    validate(make_config({"accum_dtype": "bfloat16"}), 8)


def test_accum_dtype_set_past_make_config_is_caught_by_validate():
    bad = dataclasses.replace(make_config(), accum_dtype="int8")
    with pytest.raises(ConfigError, match=r"^accum_dtype='int8' is not one of"):
        validate(bad, 8)


def test_tpu_async_collectives_defaults_off_and_parses_true_and_false():
    assert make_config().tpu_async_collectives is False
    for raw, want in (("true", True), ("false", False), ("False", False), ("1", True)):
        config = make_config(parse_overrides([f"tpu_async_collectives={raw}"]))
        assert config.tpu_async_collectives is want
        validate(config, 8)
    with pytest.raises(ConfigError, match=r"^tpu_async_collectives='maybe' is not a boolean"):
        make_config({"tpu_async_collectives": "maybe"})


def test_compiler_options_are_tpu_only_and_follow_the_key():
    on, off = make_config({"tpu_async_collectives": "true"}), make_config()
    for config in (on, off):
        # CPU and GPU compiles reject the TPU names: they must get no TPU option.
        assert compiler_options(config, "cpu") == {}
        assert compiler_options(config, "gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert compiler_options(off, "tpu") == {}
    tpu = compiler_options(on, "tpu")
    assert tpu == TPU_ASYNC_COLLECTIVES and tpu["xla_enable_async_all_reduce"] == "true"
    assert tpu["xla_jf_crs_combiner_threshold_count"] == "1"
    # Left out: beside the all-reduce options they break AOT compiles (xla_options).
    assert not any("reduce_scatter" in name for name in tpu)
    assert all(isinstance(v, str) for v in tpu.values())  # compile options as strings
    tpu["xla_enable_async_all_reduce"] = "false"  # a copy: callers cannot edit the set
    assert TPU_ASYNC_COLLECTIVES["xla_enable_async_all_reduce"] == "true"


def test_gpu_gemm_picks_cublas_by_default_and_triton_on_request():
    assert make_config().gpu_gemm == "cublas"
    triton = make_config({"gpu_gemm": "triton"})
    assert compiler_options(triton, "gpu") == {}  # XLA's default: Triton GEMM fusions
    # Only GPU compiles take the option: CPU and TPU compilers do not know it.
    for platform in ("cpu", "tpu"):
        assert compiler_options(make_config(), platform) == {}
    options = compiler_options(make_config(), "gpu")
    options["xla_gpu_enable_triton_gemm"] = True  # a copy: callers cannot edit the set
    assert compiler_options(make_config(), "gpu") == {"xla_gpu_enable_triton_gemm": False}
    with pytest.raises(ConfigError, match="gpu_gemm"):
        make_config({"gpu_gemm": "cutlass"})


def test_compiler_options_read_the_platform_of_the_mesh():
    import jax

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1])
    assert platform_of(mesh) == "cpu"
    assert for_mesh(make_config(), mesh) == {}


def test_at_least_fifteen_bad_configurations():
    assert len(BAD) >= 15


def test_overrides_parse_and_convert():
    config = make_config(
        parse_overrides(["steps=7", "learning_rate=1e-4", "shard_mode=auto", "scan_layers=False"])
    )
    assert (config.steps, config.learning_rate, config.shard_mode) == (7, 1e-4, "auto")
    assert config.scan_layers is False
    with pytest.raises(ConfigError, match="'steps' is not of the form key=value"):
        parse_overrides(["steps"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_configs(name):
    config = make_config({"model_name": name})
    assert isinstance(config, Config) and config.model_name == name
    assert config.num_moe_layers == config.base_num_decoder_layers - config.first_num_dense_layers


def test_presets_with_maxtext_names_have_maxtexts_shapes():
    # MaxText's configs/models/deepseek3-tiny.yml and deepseek3-test.yml.
    tiny = make_config({"model_name": "deepseek3-tiny"})
    assert (tiny.vocab_size, tiny.base_num_decoder_layers, tiny.first_num_dense_layers) == (
        129_280,
        61,
        3,
    )
    assert (tiny.base_emb_dim, tiny.num_experts, tiny.num_experts_per_tok) == (64, 16, 8)
    assert (tiny.kv_lora_rank, tiny.qk_nope_head_dim, tiny.qk_rope_head_dim) == (16, 128, 64)
    assert tiny.v_head_dim == 128
    test = make_config({"model_name": "deepseek3-test"})
    assert (test.base_emb_dim, test.base_num_decoder_layers, test.num_experts) == (7168, 1, 256)
    # MaxText's default remat policy (base.yml), which its deepseek3 presets run with.
    assert tiny.remat_policy == test.remat_policy == "full"
    # The small CPU presets are tagtrain's own, under names MaxText does not use.
    assert make_config({}).model_name == "tagtrain-tiny"


def test_global_batch_is_per_device_batch_times_devices_times_ga():
    from trainer.config.validate import global_batch_size

    config = make_config({"per_device_batch_size": "2", "gradient_accumulation_steps": "4"})
    assert global_batch_size(config.accumulation, config.data, 8) == 2 * 8 * 4
    assert validate(config, 8)["data"] == 8


def test_preset_values_then_overrides():
    config = make_config({"model_name": "deepseek3-671b", "num_experts": "64"})
    assert config.base_emb_dim == 7168 and config.num_experts == 64


def test_mesh_fill():
    config = make_config({"ici_fsdp_parallelism": "2", "ici_tensor_parallelism": "2"})
    sizes = mesh_shape(config, 8)
    assert sizes == {
        "stage": 1,
        "dcn_data": 1,
        "dcn_fsdp": 1,
        "data": 2,
        "fsdp": 2,
        "tensor": 2,
        "tensor_transpose": 1,
        "context": 1,
        "expert": 1,
    }


# MaxText's configs/base.yml: every cross-slice key it has.
MAXTEXT_DCN_KEYS = (
    "dcn_data_parallelism",
    "dcn_fsdp_parallelism",
    "dcn_fsdp_transpose_parallelism",
    "dcn_sequence_parallelism",
    "dcn_context_parallelism",
    "dcn_context_autoregressive_parallelism",
    "dcn_tensor_parallelism",
    "dcn_tensor_transpose_parallelism",
    "dcn_tensor_sequence_parallelism",
    "dcn_pipeline_parallelism",
    "dcn_expert_parallelism",
    "dcn_autoregressive_parallelism",
    "dcn_diloco_parallelism",
)


def test_every_maxtext_dcn_key_parses_and_only_data_fsdp_pipeline_and_expert_may_exceed_one():
    # A MaxText command line with every dcn_ key at its default parses and validates.
    defaults = {key: "-1" if key == "dcn_data_parallelism" else "1" for key in MAXTEXT_DCN_KEYS}
    assert validate(make_config(parse_overrides([f"{k}={v}" for k, v in defaults.items()])), 8)
    assert set(OTHER_DCN_KEYS) == set(MAXTEXT_DCN_KEYS) - {
        "dcn_data_parallelism",
        "dcn_fsdp_parallelism",
        "dcn_pipeline_parallelism",
        "dcn_expert_parallelism",
    }
    for key in OTHER_DCN_KEYS:
        config = make_config({key: "2", "num_slices": "2", "dcn_data_parallelism": "1"})
        # One line naming the key, raised before any mesh is sized (so before compiling).
        with pytest.raises(
            ConfigError, match=rf"^{key}=2 is not supported: only dcn_data_parallelism, dcn_fsdp"
        ) as e:
            validate(config, 8, 2)
        assert "\n" not in str(e.value)
        with pytest.raises(ConfigError, match=rf"^{key}=2 "):
            mesh_shape(config, 16, 2)  # what the AOT path checks before libtpu loads
