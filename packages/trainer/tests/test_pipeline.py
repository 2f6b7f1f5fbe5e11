"""Pipeline parallelism (model/pipeline.py): the keys' refusals, the stage axis, and the
unpipelined run's numbers with one gradient reduction per step after the pipeline loop."""

import numpy as np
import pytest

import hlo_tools as ht
from trainer.config import ConfigError, make_config, mesh_shape
from trainer.config.pipeline import (
    bubble_fraction,
    layer_slots,
    padded_layers,
    slots_per_chunk,
)
from trainer.config.validate import validate
from trainer.model.pipeline import circular_tables

# 1 dense + 4 MoE layers (4 splits over 2 and 4 stages), one MTP depth, 4 microbatches.
MODEL = {
    "base_num_decoder_layers": "5",
    "mtp_num_layers": "1",
    "gradient_accumulation_steps": "4",
}
# Layouts against the unpipelined data=8 run: each one's keys over MODEL's.
STAGE2 = {"ici_pipeline_parallelism": "2"}
STAGES = {
    "stage=2 x data=4": {**STAGE2, "ici_data_parallelism": "4"},
    "stage=4 x data=2": {"ici_pipeline_parallelism": "4", "ici_data_parallelism": "2"},
    "stage=2 x data=4, auto": {**STAGE2, "ici_data_parallelism": "4", "shard_mode": "auto"},
    "stage=2 x data=4, circular (2 repeats)": {
        **STAGE2, "ici_data_parallelism": "4", "num_pipeline_repeats": "2",
    },
    "stage=2 x data=4, ZeRO-1": {
        **STAGE2, "ici_data_parallelism": "4", "shard_optimizer_over_data": "true",
    },
    # Expert parallelism inside the stages: each device its stage's layers and its
    # own 4 of the 8 experts, the routed rows moved by all-to-all (in the loop).
    "stage=2 x expert=2 x data=2": {
        **STAGE2, "ici_expert_parallelism": "2", "ici_data_parallelism": "2",
    },
    # FSDP inside the stages: the weights gathered once per step, before the loop.
    "stage=2 x fsdp=2 x data=2": {
        **STAGE2, "ici_fsdp_parallelism": "2", "ici_data_parallelism": "2",
    },
    # Both: the expert kernels gathered over fsdp (their embed dim), still split over
    # expert on dim 1 (dim 0 the layers').
    "stage=2 x expert=2 x fsdp=2": {
        **STAGE2, "ici_expert_parallelism": "2", "ici_fsdp_parallelism": "2",
        "ici_data_parallelism": "1",
    },
    "stage=2 x expert=2 x fsdp=2, auto": {
        **STAGE2, "ici_expert_parallelism": "2", "ici_fsdp_parallelism": "2",
        "ici_data_parallelism": "1", "shard_mode": "auto",
    },
    # Tensor parallelism inside the stages: attention's heads split over 'tensor'
    # (its output projection's partial sums psummed in the loop), the MoE block whole
    # over it (its kernels gathered once per step, before the loop).
    "stage=2 x tensor=2 x data=2": {
        **STAGE2, "ici_tensor_parallelism": "2", "ici_data_parallelism": "2",
    },
    "stage=2 x tensor=2 x data=2, auto": {
        **STAGE2, "ici_tensor_parallelism": "2", "ici_data_parallelism": "2",
        "shard_mode": "auto",
    },
    # Context parallelism inside the stages: each device its rows' sequence chunk, the
    # keys and values (and the MTP shift's token ids, in the head) gathered whole
    # along the sequence over 'context' (ShardCtx.relayout), in the loop.
    "stage=2 x context=2 x data=2": {
        **STAGE2, "ici_context_parallelism": "2", "ici_data_parallelism": "2",
    },
    "stage=2 x context=2 x tensor=2, auto": {
        **STAGE2, "ici_context_parallelism": "2", "ici_tensor_parallelism": "2",
        "ici_data_parallelism": "1", "shard_mode": "auto",
    },
    # The expert axis sharding attention's sequence (expert_shard_attention_option=
    # context), the MoE's tokens split over it as well.
    "stage=2 x expert=2 (sharding the sequence) x data=2": {
        **STAGE2, "ici_expert_parallelism": "2", "ici_data_parallelism": "2",
        "expert_shard_attention_option": "context",
    },
    # With FSDP: attention's weights gathered over fsdp inside the map, still split
    # over 'tensor'; the MoE block's gathered over both.
    "stage=2 x tensor=2 x fsdp=2": {
        **STAGE2, "ici_tensor_parallelism": "2", "ici_fsdp_parallelism": "2",
        "ici_data_parallelism": "1",
    },
    # With experts split over 'expert' (a batch axis: the routed rows' all-to-all) and
    # circular stages (the attention's head-split chunks and the MoE's whole ones
    # relayed to their stages once per step).
    "stage=2 x tensor=2 x expert=2, circular (2 repeats)": {
        **STAGE2, "ici_tensor_parallelism": "2", "ici_expert_parallelism": "2",
        "ici_data_parallelism": "1", "num_pipeline_repeats": "2",
    },
    # Uneven stages: 3 MoE layers over 2 stages (2 chunks of 2 slots, the last one's
    # second padding), and 5 over 2 stages x 2 repeats (4 chunks of 2 slots, 3 padded).
    "uneven: 3 layers over stage=2 x data=4": {
        **STAGE2, "ici_data_parallelism": "4", "base_num_decoder_layers": "4",
    },
    # DeepSeek-V3's layout in small, uneven: the padding slot's all-to-alls run too.
    "uneven: 3 layers over stage=2 x expert=2 x data=2": {
        **STAGE2, "ici_expert_parallelism": "2", "ici_data_parallelism": "2",
        "base_num_decoder_layers": "4",
    },
    # The experts across 2 emulated slices (dcn_expert_parallelism=2), the stages
    # inside each: the 'expert' axis' cross-slice part in the stages' all-to-alls.
    "stage=2 x expert=2 (across 2 slices) x data=2": {
        **STAGE2, "num_slices": "2", "dcn_data_parallelism": "1",
        "dcn_expert_parallelism": "2", "ici_data_parallelism": "2",
    },
    "uneven: 5 layers over stage=2 x data=4, circular (2 repeats)": {
        **STAGE2, "ici_data_parallelism": "4", "base_num_decoder_layers": "6",
        "num_pipeline_repeats": "2",
    },
    # The sequence-wise balance loss (a term per microbatch, weighted by its tokens)
    # and the router z-loss (a term per token): both leave the pipeline per
    # microbatch (circular and uneven: the repeat and microbatch each iteration
    # writes, the padding slots left out).
    "stage=2 x data=4, balance and z losses": {
        **STAGE2, "ici_data_parallelism": "4", "load_balance_loss_weight": "0.1",
        "moe_z_loss_coeff": "0.01",
    },
    "uneven: 5 layers over stage=2 x expert=2 x data=2, circular, balance and z losses": {
        **STAGE2, "ici_expert_parallelism": "2", "ici_data_parallelism": "2",
        "base_num_decoder_layers": "6", "num_pipeline_repeats": "2",
        "load_balance_loss_weight": "0.1", "moe_z_loss_coeff": "0.01",
    },
}  # fmt: skip
# Keys of a layout that change the model or its loss: the unpipelined run has them too.
MODEL_KEYS = ("base_num_decoder_layers", "load_balance_loss_weight", "moe_z_loss_coeff")

# The 6-layer model's deeper sums: one embedding entry of 16384 off by 3.2e-10 at
# rtol 1e-5 (its atol, rtol / 10 of the leaf's largest, 3.05e-10): f32 rounding.
GRAD_RTOL = {
    "uneven: 5 layers over stage=2 x data=4, circular (2 repeats)": 2e-5,
    "uneven: 5 layers over stage=2 x expert=2 x data=2, circular, balance and z losses": 2e-5,
}

BAD = [
    (
        {"ici_pipeline_parallelism": "2", "ici_data_parallelism": "4"},
        # tagtrain-tiny: 3 layers, 1 dense: 2 MoE layers split over 2 stages, but GA=1
        # leaves one microbatch for two stages.
        r"^num_pipeline_microbatches=1 is fewer than the 2 stages",
    ),
    (
        # Uneven stages pad their chunks, but not to a chunk with no layer at all.
        {**MODEL, "base_num_decoder_layers": "4", "ici_pipeline_parallelism": "4"},
        r"^ici_pipeline_parallelism=4 x dcn_pipeline_parallelism=1 = 4 stages x "
        r"num_pipeline_repeats=1: the 3 MoE layers .* are fewer than the 4 chunks: some "
        r"chunk would hold no layer$",
    ),
    (
        {**MODEL, "ici_pipeline_parallelism": "2", "num_pipeline_repeats": "4"},
        r"^ici_pipeline_parallelism=2 x dcn_pipeline_parallelism=1 = 2 stages x "
        r"num_pipeline_repeats=4: the 4 MoE layers .* are fewer than the 8 chunks",
    ),
    (
        {**MODEL, "ici_pipeline_parallelism": "2", "num_pipeline_microbatches": "8"},
        r"^num_pipeline_microbatches=8 must equal gradient_accumulation_steps=4",
    ),
    (
        {**MODEL, "ici_pipeline_parallelism": "2", "ici_tensor_transpose_parallelism": "2"},
        r"^ici_tensor_transpose_parallelism=2 with 2 pipeline stages is not supported: it "
        r"splits a layer's compute",
    ),
    (
        {**MODEL, "ici_pipeline_parallelism": "2", "gradient_accumulation_schedule": "overlapped"},
        r"^gradient_accumulation_schedule=overlapped with 2 pipeline stages",
    ),
    (
        {**MODEL, "ici_pipeline_parallelism": "2", "gradient_reduction_policy": "per_microbatch"},
        r"^gradient_reduction_policy=per_microbatch with 2 pipeline stages would reduce inside",
    ),
    ({"num_pipeline_repeats": "0"}, r"^num_pipeline_repeats=0 must be >= 1"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[",".join(o) for o, _ in BAD])
def test_bad_pipeline_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(overrides), 8)


def test_stage_axis_outermost_and_across_slices():
    config = make_config({**MODEL, "ici_pipeline_parallelism": "2"})
    sizes = mesh_shape(config, 8)
    assert list(sizes)[0] == "stage"
    assert (sizes["stage"], sizes["data"]) == (2, 4)
    # dcn_pipeline_parallelism: the stages' cross-slice part, times the in-slice one.
    config = make_config(
        {**MODEL, "dcn_pipeline_parallelism": "2", "dcn_data_parallelism": "1", "num_slices": "2"}
    )
    sizes = mesh_shape(config, 8, num_slices=2)
    assert (sizes["stage"], sizes["dcn_data"], sizes["data"]) == (2, 1, 4)


@pytest.mark.parametrize(("stages", "repeats"), [(2, 2), (4, 2), (2, 3), (4, 8), (3, 1)])
def test_circular_relayout_delivers_every_chunk_once(stages, repeats):
    # Chunk c is stored on stage c // repeats and run by stage c % stages as its
    # repeat c // stages: the permute rounds must deliver each exactly there, once.
    send, recv = circular_tables(stages, repeats)
    got = {}
    for d in range(stages):
        for b in range(stages):
            s = (b + d) % stages
            for local, k in zip(send[d, b], recv[d, s], strict=True):
                if k == repeats:  # padding
                    continue
                assert (s, int(k)) not in got
                got[(s, int(k))] = b * repeats + int(local)
    want = {(c % stages, c // stages): c for c in range(stages * repeats)}
    assert got == want


@pytest.mark.parametrize("repeats", [1, 2])
def test_uneven_slots_keep_the_layer_order(repeats):
    # DeepSeek-V3: 58 MoE layers over 16 stages (x repeats) chunks of c slots.
    chunks = 16 * repeats
    c = slots_per_chunk(58, 16, repeats)
    assert c == (4 if repeats == 1 else 2)
    assert padded_layers(58, 16, repeats) == chunks * c
    slots = layer_slots(58, 16, repeats)
    # Every layer a slot of its own, in the model's order.
    assert len(slots) == 58 and list(slots) == sorted(set(slots))
    per_chunk = np.bincount(np.asarray(slots) // c, minlength=chunks)
    # Chunks differ by at most one real layer; the padding the last chunks' last slots.
    assert set(per_chunk) == {c - 1, c}
    assert list(per_chunk) == sorted(per_chunk, reverse=True)
    for j in range(chunks):
        held = [s % c for s in slots if s // c == j]
        assert held == list(range(per_chunk[j]))  # consecutive from the chunk's start
    assert layer_slots(8, 4, 2) == tuple(range(8))  # even: slot i is layer i
    # 3 layers over 2 stages: chunk 0 layers 0 and 1, chunk 1 layer 2 then padding.
    assert layer_slots(3, 2) == (0, 1, 2)
    assert layer_slots(5, 2, 2) == (0, 1, 2, 4, 6)


def test_uneven_startup_line_names_the_padding():
    from trainer.run import report

    config = make_config({**MODEL, "base_num_decoder_layers": "4", "ici_pipeline_parallelism": "2"})
    line = report.pipeline_lines(config, {"stage": 2, "data": 4})[0]
    assert line.startswith(
        "pipeline: 2 stages x 2 MoE layer slots per chunk (uneven: 3 MoE layers in 4 slots, "
        "1 padding = 25.0%, the last slot of the last 1 chunks) (GPipe)"
    )
    even = report.pipeline_lines(
        make_config({**MODEL, "ici_pipeline_parallelism": "2"}), {"stage": 2}
    )
    assert even[0].startswith("pipeline: 2 stages x 2 MoE layer slots per chunk (GPipe)")


def test_bubble_fraction():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4, repeats=2) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 4) == 0.0


@pytest.mark.slow  # a compile of the tiny model each (about a minute on 2 cores)
@pytest.mark.parametrize("layout", list(STAGES))
def test_same_numbers_and_one_reduction_after_the_loop(runner, grads_runner, grads_match, layout):
    keys = {**MODEL, **STAGES[layout]}
    # The unpipelined run of the same model and loss (an uneven layout's own layer
    # count, the balance loss where the layout has it).
    model = {**MODEL, **{k: keys[k] for k in MODEL_KEYS if k in keys}}
    stages, repeats = keys["ici_pipeline_parallelism"], keys.get("num_pipeline_repeats", "1")
    want_history, _ = runner(1, **model, ici_data_parallelism="8")
    got_history, text = runner(1, **keys)
    for name in ("loss", "ce_loss", "mtp_loss_1", "grad_norm"):
        np.testing.assert_allclose(got_history[0][name], want_history[0][name], rtol=1e-5)
    want, got = grads_runner(1, **model, ici_data_parallelism="8"), grads_runner(1, **keys)
    moe_layers = int(keys["base_num_decoder_layers"]) - 1
    slots = list(layer_slots(moe_layers, int(stages), int(repeats)))
    for leaf in [k for k in got if k.startswith("moe_layers/")]:
        # Uneven stages: the padding slots' gradients exactly zero, the real ones the
        # unpipelined run's layers in order.
        assert not np.delete(got[leaf], slots, axis=0).any(), leaf
        got[leaf] = got[leaf][slots]
    assert "moe_layers/ffn/wi_0" in got and "mtp/eh_proj_2xDxD" in got
    grads_match(got, want, rtol=GRAD_RTOL.get(layout, 1e-5))
    module = ht.parse(text)
    slices = int(keys.get("num_slices", "1"))
    sizes = mesh_shape(make_config({"model_name": "tagtrain-tiny", **keys}), 8, slices)
    judged = ht.verdict(module, mesh_shape=sizes, over=("data",))
    assert judged["status"] == "OK" and judged["in_loop"] == 0, judged["message"]
    assert judged["outside"] >= 1  # the gradients' one reduction, after the loop
    # The pipeline loop: m + p - 1 iterations, its only collectives the permutes that
    # move the microbatches between stages (forward and backward) and, with experts
    # sharded, the routed rows' all-to-alls; no reduction at all (FSDP's gathers and
    # reduce-scatters once per step, outside it).
    trips = 4 * int(repeats) + int(stages) - 1
    in_loop = [c for c in ht.collectives(module) if c.multiplier > 1]
    permutes = [c for c in in_loop if c.kind == "collective-permute"]
    assert permutes and {c.multiplier for c in permutes} == {trips}
    # The experts' all-to-alls: in each stage's layer scan inside the loop (its
    # chunk's slots, padding included), and the MTP depth's MoE block's in the head's
    # scan over the 4 microbatches (model/pipeline_ends.py).
    per_iteration = slots_per_chunk(moe_layers, int(stages), int(repeats))
    rest = {(c.kind, c.multiplier) for c in in_loop if c.kind != "collective-permute"}
    expert = sizes.get("expert", 1) > 1
    want = {("all-to-all", trips * per_iteration), ("all-to-all", 4)} if expert else set()
    if sizes.get("tensor", 1) > 1:
        # Tensor parallelism's own: attention's partial sums over its split heads, in
        # each stage's layer scan (forward, and the input's cotangent in the backward),
        # over 'tensor' alone; the ends and the MoE blocks run whole over it.
        tensor = [c for c in in_loop if c.kind == "all-reduce"]
        assert tensor and ht.spanned_axes(tensor, sizes) == ("tensor",)
        want.add(("all-reduce", trips * per_iteration))
    # The axes splitting the sequence: context, and expert where it shards attention's
    # sequence (expert_shard_attention_option=context).
    sequence_axes = {a for a in ("context", "expert") if sizes.get(a, 1) > 1} - (
        set() if keys.get("expert_shard_attention_option") == "context" else {"expert"}
    )
    if sequence_axes:
        # Context parallelism's own, over those axes alone: the keys and values gathered
        # along the sequence (their cotangents reduce-scattered back) in each stage's
        # layers and in the ends' scans over the 4 microbatches (the dense layer, the
        # MTP shift's token ids); the positions once per pipeline iteration.
        sequence = [c for c in in_loop if c.kind in ("all-gather", "reduce-scatter")]
        assert sequence and set(ht.spanned_axes(sequence, sizes)) <= sequence_axes
        assert {c.multiplier for c in sequence} <= {trips * per_iteration, trips, 4}
        rest -= {(c.kind, c.multiplier) for c in sequence}
    assert rest == want
    if sizes.get("fsdp", 1) > 1:
        once = {c.kind for c in ht.collectives(module) if c.multiplier == 1}
        assert {"all-gather", "reduce-scatter"} <= once
    # The cost model's stage permutes are the compiled program's, byte for byte
    # (float32 here: XLA:CPU sends bf16 permutes as f32; the aot test checks bf16).
    runner_keys = {"model_name": "tagtrain-tiny", "dtype": "float32", "per_device_batch_size": "1"}
    assert_predicted_permutes(module, {**runner_keys, **keys})


def assert_predicted_permutes(module, overrides: dict) -> None:
    """step/pipeline_cost's permute bytes (auto's startup figures) equal hlo_tools'
    count of the compiled step's collective-permutes, inside the loop and outside."""
    from trainer.run import spec

    planned = spec.resolve_abstract(make_config(overrides), 8, int(overrides.get("num_slices", 1)))
    pipe = planned.choice.pipeline
    # The pipeline's own permutes (jax's ppermute), not the ones XLA's partitioner adds
    # to reshard in shard_mode=auto (named collective-permute, outside the loop).
    hops = [c for c in ht.collectives(module) if "ppermute" in c.name + c.op_name]
    traffic = ht.traffic(hops)
    counted = {
        where: traffic[where].get("collective-permute", {}).get("bytes_per_step", 0)
        for where in ("in_loop", "outside")
    }
    assert counted == {
        "in_loop": pipe.permute_bytes_in_loop,
        "outside": pipe.permute_bytes_outside,
    }


def test_plan_reduction_shows_the_stage_axis(capsys):
    from trainer.run import plan_reduction

    args = [
        "compile_topology=v5e-8",
        "ici_pipeline_parallelism=2",
        *(f"{k}={v}" for k, v in MODEL.items()),
    ]
    assert plan_reduction.main(args) == 0
    out = capsys.readouterr().out
    assert "mesh stage=2, data=4" in out
    # The bubble of 2 stages and 4 microbatches, and auto's one policy with stages.
    assert "5 iterations: bubble (p-1)/(m x repeats+p-1) = 1/5 = 20.0%" in out
    assert "gradient_reduction_policy=auto -> deferred (v5e figures" in out
    assert "pipeline stages: deferred (one reduction after the pipeline loop)" in out
    # Priced with the stage axis: deferred's row, then what the stages add.
    assert any(
        line.split()[:1] == ["deferred"] and "<- chosen" in line for line in out.splitlines()
    )
    assert "pipeline (predicted): compute" in out and "MiB in the loop" in out


@pytest.mark.slow  # four runs set up (initialised and placed) on 8 devices
def test_a_checkpoint_resumes_across_a_change_of_stage_count(tmp_path):
    # The stacked layers are stored as one array per parameter whatever the stages
    # (GPipe's and the circular layout's alike): a checkpoint of stage=2 restores
    # onto stage=4 and onto no stages, in those runs' shardings. No compile needed.
    import jax

    from trainer.run import run as run_lib

    base = {
        **MODEL,
        "base_output_directory": str(tmp_path),
        "run_name": "stages",
        "async_checkpointing": "false",
    }
    first = run_lib.setup(make_config({**base, "ici_pipeline_parallelism": "2"}))
    # Not the seed's initial values (every run draws those): a state only the save has.
    saved = jax.tree.map(lambda x: x * 2 + 1, first.state["params"])
    first.checkpoints.save(1, {**first.state, "params": saved})
    first.checkpoints.wait()
    for stages, repeats in (("4", "1"), ("1", "1"), ("2", "2")):
        overrides = {"ici_pipeline_parallelism": stages, "num_pipeline_repeats": repeats}
        resumed = run_lib.setup(make_config({**base, **overrides}))
        assert resumed.start_step == 1
        moe = resumed.state["params"]["moe_layers"]["ffn"]["wi_0"]
        assert moe.sharding.spec[0] == ("stage" if stages != "1" else None)
        for got, want in zip(
            jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(saved), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow  # four runs set up (initialised and placed) on 8 devices
@pytest.mark.parametrize(("saved_on", "resumed_on"), [("2", "1"), ("1", "2")])
def test_an_uneven_checkpoint_holds_the_real_layers(tmp_path, saved_on, resumed_on):
    # 3 MoE layers over 2 stages: 4 slots in memory (the last one padding, zeros),
    # 3 layers in the checkpoint, so it resumes on either stage count.
    import jax

    from trainer.run import run as run_lib

    base = {
        **MODEL,
        "base_num_decoder_layers": "4",
        "base_output_directory": str(tmp_path),
        "run_name": "uneven",
        "async_checkpointing": "false",
    }
    slots = list(layer_slots(3, 2))
    unpiped = run_lib.setup(make_config({**base, "run_name": "fresh"}))
    piped = run_lib.setup(
        make_config({**base, "run_name": "fresh2", "ici_pipeline_parallelism": "2"})
    )

    def real(params: dict, stages: str) -> list:
        # The real layers' values whatever the stack's padding.
        out = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            value = np.asarray(leaf)
            if stages == "2" and "moe_layers" in jax.tree_util.keystr(path):
                assert value.shape[0] == 4 and not np.delete(value, slots, axis=0).any()
                value = value[slots]
            out.append(value)
        return out

    # Initial weights: the real layers drawn as without stages, the padding zeros.
    for a, b in zip(
        real(piped.state["params"], "2"), real(unpiped.state["params"], "1"), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    first = run_lib.setup(make_config({**base, "ici_pipeline_parallelism": saved_on}))
    # A state only the save has, the padding still zeros (as training keeps it).
    saved = jax.tree.map(lambda x: x * 2 + 1, first.state["params"])
    if saved_on == "2":
        real_rows = np.isin(np.arange(4), slots)
        saved = {**saved, "moe_layers": jax.tree.map(
            lambda x: x * real_rows.reshape(4, *(1,) * (x.ndim - 1)), saved["moe_layers"]
        )}  # fmt: skip
    first.checkpoints.save(1, {**first.state, "params": saved})
    first.checkpoints.wait()
    resumed = run_lib.setup(make_config({**base, "ici_pipeline_parallelism": resumed_on}))
    assert resumed.start_step == 1
    moe = resumed.state["params"]["moe_layers"]["ffn"]["wi_0"]
    assert moe.shape[0] == (4 if resumed_on == "2" else 3)
    assert moe.sharding.spec[0] == ("stage" if resumed_on != "1" else None)
    want = real(saved, saved_on)
    for a, b in zip(real(resumed.state["params"], resumed_on), want, strict=True):
        np.testing.assert_array_equal(a, b)
    # The same checkpoint as another run's initial weights (load_parameters_path).
    loaded = run_lib.setup(
        make_config({
            **base, "run_name": "loaded", "ici_pipeline_parallelism": resumed_on,
            "load_parameters_path": first.checkpoints.directory,
        })
    )  # fmt: skip
    for a, b in zip(real(loaded.state["params"], resumed_on), want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # one compile of the tiny model and two steps
def test_uneven_padding_stays_zero_through_training():
    # AdamW on a zero gradient (weight decay on zero weights) leaves the padding slots
    # zero: parameters, router biases and both moments, after two steps.
    import jax

    from trainer.run import run as run_lib

    keys = {
        **MODEL,
        "model_name": "tagtrain-tiny",
        "dtype": "float32",
        "base_num_decoder_layers": "4",
        "ici_pipeline_parallelism": "2",
        "per_device_batch_size": "1",
        "steps": "2",
        "adam_weight_decay": "0.1",
    }
    run = run_lib.setup(make_config(keys))
    run_lib.compile_step(run)
    run_lib.train(run)
    padding = np.delete(np.arange(4), list(layer_slots(3, 2)))
    stacks = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(run.state)[0]:
        if "moe_layers" in jax.tree_util.keystr(path) and leaf.shape[:1] == (4,):
            stacks += 1
            assert not np.asarray(leaf)[padding].any(), jax.tree_util.keystr(path)
    assert stacks > 10  # the parameters, the biases and Adam's two moments of them


AOT_LAYOUTS = {
    "stage=2 x data=4": {},
    # DeepSeek-V3's layout in small: expert parallelism inside the stages.
    "stage=2 x expert=2 x data=2": {"ici_expert_parallelism": "2", "ici_data_parallelism": "2"},
    # Uneven: 3 MoE layers in 2 chunks of 2 slots (the padding slot runs, thrown away).
    "uneven: 3 layers over stage=2 x expert=2 x data=2": {
        "ici_expert_parallelism": "2",
        "ici_data_parallelism": "2",
        "base_num_decoder_layers": "4",
    },
}


# The even stage x expert compile is in slow_aot only: the uneven one (experts and a
# padding slot) covers its collectives in CI's aot tier at one compile's cost.
AOT_SLOW = ("stage=2 x expert=2 x data=2",)


@pytest.mark.aot  # XLA:TPU (libtpu, the `tpu` extra), compiled on this host, not run
@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in AOT_SLOW else k for k in AOT_LAYOUTS],
)
def test_v5e8_pipeline_compiles_with_no_reduction_in_its_loop(tmp_path, layout):
    from trainer.run import aot

    keys = {
        **MODEL,
        "compile_topology": "v5e-8",
        "ici_pipeline_parallelism": "2",
        "per_device_batch_size": "1",
        "base_output_directory": str(tmp_path),
        **AOT_LAYOUTS[layout],
    }
    result = aot.compile_for_topology(make_config(keys))
    text = result.compiled.as_text()
    # Not even a scalar reduced inside a loop: the gradients, loss sums and token
    # counts all after the pipeline loop.
    assert ht.assert_reduced_once_per_step(text, max_in_loop_elements=0)
    in_loop = [c for c in ht.collectives(ht.parse(text)) if c.multiplier > 1]
    permutes = [c for c in in_loop if c.kind == "collective-permute"]
    assert permutes and {c.multiplier for c in permutes} == {4 + 2 - 1}  # m + p - 1 iterations
    # With experts sharded, the routed rows' all-to-alls (2 layers a stage per
    # iteration), and the MTP block's once per microbatch in the head's scan.
    rest = {(c.kind, c.multiplier) for c in in_loop if c.kind != "collective-permute"}
    expert = {("all-to-all", 2 * (4 + 2 - 1)), ("all-to-all", 4)}
    assert rest == (expert if AOT_LAYOUTS[layout] else set())
    assert result.memory["total"] < result.hbm_bytes
    assert any(line.startswith("pipeline: 2 stages") for line in aot.report_lines(result))
    # bf16 activations on the wire, as the cost model prices them.
    assert_predicted_permutes(ht.parse(text), keys)


def test_evaluation_lowers_with_the_z_loss_on():
    """The layers return their router z whenever the z-loss is on; only the training
    loss takes it out of the pipeline (`run_stacked(router_z=True)`). Evaluation's
    pipeline (run_pipeline) must not carry it out of its map: it used to, and its
    shard_map refused the extra output."""
    import jax

    from trainer.run import run as run_lib

    keys = {**MODEL, **STAGE2, "ici_data_parallelism": "4", "moe_z_loss_coeff": "0.01"}
    config = make_config(
        {
            "model_name": "tagtrain-tiny",
            **keys,
            "per_device_batch_size": "2",
            "eval_interval": "1",
            "eval_steps": "1",
        }
    )
    run = run_lib.setup(config, jax.devices()[:8])
    evaluator, state = run.evaluator, run.state
    with jax.set_mesh(evaluator.ctx.mesh):
        lowered = evaluator.step_fn.lower(
            state["params"], state["router"], evaluator.batch(0), evaluator.zeros_fn(), None
        )
    # The eval step runs the stages: their activations move by collective-permute.
    assert "collective_permute" in lowered.as_text()


def test_eval_batch_must_split_into_the_pipeline_microbatches():
    """With stages an eval batch runs as the pipeline's microbatches, each split over
    the batch shards: a batch that does not is refused before anything compiles
    (it used to fail inside the compile)."""
    from trainer.data.eval_data import make_eval_set

    keys = {**MODEL, **STAGE2, "ici_data_parallelism": "4", "eval_interval": "1", "eval_steps": "1"}
    config = make_config({"model_name": "tagtrain-tiny", **keys, "per_device_batch_size": "1"})
    with pytest.raises(
        ConfigError,
        match=r"^eval batch of 8 sequences .* does not split over "
        r"the 4 pipeline microbatches x 4 batch shards",
    ):
        make_eval_set(config, 8, mesh_shape(config, 8))
    # 16 sequences: 4 microbatches of 4, one row per data shard.
    doubled = make_config({"model_name": "tagtrain-tiny", **keys, "per_device_batch_size": "2"})
    assert make_eval_set(doubled, 8, mesh_shape(doubled, 8)).batch_size == 16


@pytest.mark.aot
@pytest.mark.slow  # slow_aot: one more v5e-8 compile (about a minute on 2 cores)
def test_v5e8_context_inside_the_stages_compiles(tmp_path):
    """XLA:TPU with the sequence split inside the stages: the gradients still reduced
    over 'data' once after the loop; in the loop only activations move over
    'context' (keys and values gathered, their cotangents summed back, which XLA:TPU
    writes as all-reduces over 'context')."""
    from trainer.run import aot

    keys = {
        **MODEL,
        "model_name": "tagtrain-tiny",
        "compile_topology": "v5e-8",
        **STAGE2,
        "ici_context_parallelism": "2",
        "ici_data_parallelism": "2",
        "per_device_batch_size": "1",
        "base_output_directory": str(tmp_path),
    }
    result = aot.compile_for_topology(make_config(keys))
    module = ht.parse(result.compiled.as_text())
    sizes = mesh_shape(make_config(keys), 8)
    judged = ht.verdict(module, mesh_shape=sizes, over=("data",))
    assert judged["status"] == "OK" and judged["in_loop"] == 0, judged["message"]
    assert judged["outside"] >= 1
    in_loop = [c for c in ht.collectives(module) if c.multiplier > 1]
    sequence = [c for c in in_loop if c.kind != "collective-permute"]
    assert sequence and ht.spanned_axes(sequence, sizes) == ("context",)
    assert result.memory["total"] < result.hbm_bytes
