"""Named parallelism layouts on 8 devices: the seeds' matrix, as config overrides.

Test data, not part of the trainer wheel: the tests load it by path (conftest.py
registers it as `trainer_tests_layouts`), the benchmarks through
`benchlib.trainer_test_module("layouts")`. E.g.
`make_config({**EIGHT_DEVICE_LAYOUTS["fsdp+tensor"], "steps": "10"})`.
"""

EIGHT_DEVICE_LAYOUTS = {
    "data": dict(ici_data_parallelism="8"),
    "fsdp": dict(ici_data_parallelism="1", ici_fsdp_parallelism="8"),
    "fsdp+tensor": dict(
        ici_data_parallelism="1", ici_fsdp_parallelism="4", ici_tensor_parallelism="2"
    ),
    "fsdp+tensor_transpose": dict(
        ici_data_parallelism="1", ici_fsdp_parallelism="4", ici_tensor_transpose_parallelism="2"
    ),
    "fsdp+context": dict(
        ici_data_parallelism="1", ici_fsdp_parallelism="4", ici_context_parallelism="2"
    ),
    "fsdp+expert(fsdp)": dict(
        ici_data_parallelism="1", ici_fsdp_parallelism="4", ici_expert_parallelism="2"
    ),
    "fsdp+expert(context)": dict(
        ici_data_parallelism="1",
        ici_fsdp_parallelism="4",
        ici_expert_parallelism="2",
        expert_shard_attention_option="context",
    ),
    "data+expert": dict(ici_data_parallelism="4", ici_expert_parallelism="2"),
    "data+zero1": dict(ici_data_parallelism="8", shard_optimizer_over_data="true"),
    "data+fsdp": dict(ici_data_parallelism="4", ici_fsdp_parallelism="2"),
}

# tagtrain-test, GA=4 on v5e-8 (the seed's AOT case): test_aot.py compiles it on one
# slice, test_aot_slices.py on two.
AOT_TEST_V5E8 = dict(
    model_name="tagtrain-test",
    compile_topology="v5e-8",
    gradient_accumulation_steps="4",
    per_device_batch_size="1",
)

# DeepSeek-V3 671B on one TPU slice: the routed experts over 64-way expert
# parallelism, everything else FSDP over the rest of the slice, bf16 weights and
# capped all-to-all blocks. The aot tier compiles it on v5p-1024 and the
# reduction study (benchmarks/bench_reduction_study.py) predicts it.
DEEPSEEK3_671B_LAYOUT = dict(
    model_name="deepseek3-671b",
    ici_data_parallelism="1",
    ici_expert_parallelism="64",
    ici_fsdp_parallelism="-1",
    capacity_factor="1.25",
    weight_dtype="bfloat16",
)
