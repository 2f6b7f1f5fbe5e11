"""`compile_topology`: the real train step compiled for TPU topologies on this CPU host
(libtpu from the `tpu` extra), never run. `uv run --extra tpu pytest -m aot`.

One slice (and the published DeepSeek shapes); two v5e-8 slices: test_aot_slices.py."""

import re

import jax
import pytest

import hlo_tools
from trainer import model as model_lib
from trainer.config import make_config
from trainer.run import aot
from trainer.run.spec import resolve_abstract
from trainer_tests_layouts import AOT_TEST_V5E8, DEEPSEEK3_671B_LAYOUT

pytestmark = pytest.mark.aot
pytest.importorskip("libtpu", reason="needs the tpu extra (libtpu): uv run --extra tpu")


# tagtrain-test, GA=4 on v5e-8 (the seed's AOT case); two slices of it: test_aot_slices.py.
TEST_V5E8 = AOT_TEST_V5E8


def _config(tmp_path, **overrides):
    return make_config({"base_output_directory": str(tmp_path), **overrides})


@pytest.fixture(scope="module")
def zero1_v5e8(tmp_path_factory):
    """tagtrain-test, explicit, ZeRO-1, GA=4 on v5e-8."""
    config = _config(
        tmp_path_factory.mktemp("aot"),
        **TEST_V5E8,
        shard_mode="explicit",
        shard_optimizer_over_data="true",
    )
    return aot.compile_for_topology(config)


def test_v5e8_zero1_no_gradient_reduction_in_the_loop(zero1_v5e8):
    text = zero1_v5e8.compiled.as_text()
    # Nothing is reduced inside the loop, not even a scalar (threshold 0): not the
    # gradients, not the loss sums (kept unreduced), not the router's per-expert
    # token counts (accumulated per token shard and summed once after the loop).
    outside = hlo_tools.assert_reduced_once_per_step(text, max_in_loop_elements=0)
    assert hlo_tools.traffic(hlo_tools.parse(text))["in_loop"] == {}
    params = sum(x.size for x in jax.tree.leaves(zero1_v5e8.run.state["params"]))
    # Every gradient element is reduced after the loop: a reduce-scatter into the
    # ZeRO-1 shards leaves 1/group of the sum per device, an all-reduce all of it
    # (XLA:TPU turns most of accum's reduce-scatters into all-reduces).
    reduced = sum(c.elements * (c.group_size if c.kind == "reduce-scatter" else 1) for c in outside)
    assert reduced >= params


def test_v5e8_memory_report_and_hlo_file(zero1_v5e8):
    mem = zero1_v5e8.memory
    assert mem["argument"] > 0 and mem["temp"] > 0
    assert (
        mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["code"]
    )
    assert mem["total"] < zero1_v5e8.hbm_bytes == 16 * aot.GIB
    # XLA:TPU reports its peak of live buffers: the arguments and more, within the total.
    assert mem["argument"] < mem["peak"] <= mem["total"]
    lines = aot.report_lines(zero1_v5e8)
    assert any(line.startswith("  peak ") for line in lines)
    assert any(line.startswith("  total ") and "of 16 GiB HBM" in line for line in lines)
    assert any(line.startswith("loops (outermost first)") for line in lines)  # the table
    with open(zero1_v5e8.hlo_path) as f:
        assert f.read() == zero1_v5e8.compiled.as_text()
    assert zero1_v5e8.hlo_path.endswith("tagtrain-test/aot_v5e-8.hlo")


@pytest.fixture(scope="module")
def overlap_v5e8(tmp_path_factory):
    """tagtrain-test, explicit, data=8, GA=4 on v5e-8, gradient_accumulation_schedule=overlapped,
    tpu_async_collectives=true."""
    config = _config(
        tmp_path_factory.mktemp("aot"),
        **TEST_V5E8,
        ici_data_parallelism="8",
        gradient_accumulation_schedule="overlapped",
        tpu_async_collectives="true",
    )
    return aot.compile_for_topology(config)


def test_v5e8_tpu_async_collectives_overlap_the_backward_scans_reductions(overlap_v5e8):
    # xla_options' TPU set reached the compile: some of the per-layer gradient
    # all-reduces of the last microbatch's backward scan are async collective
    # fusions with compute scheduled between start and done (libtpu's defaults
    # keep every all-reduce synchronous). Only there: with the deferred policy the
    # step's one reduction per gradient has nothing left to overlap, and XLA keeps
    # it synchronous whatever the options.
    text = overlap_v5e8.compiled.as_text()
    records = hlo_tools.async_overlap(text)
    scan = {c.name for c in hlo_tools.overlapped_reductions(text)}
    assert scan, "no reduction in the last microbatch's backward layer scan"
    hidden = [r for r in records if r.overlapped and r.collective.name in scan]
    assert hidden and all(r.kind == "all-reduce" for r in hidden), [
        (r.collective.name, r.is_async, len(r.between))
        for r in records
        if r.collective.name in scan
    ]
    grads = hlo_tools.overlap_report(text)["gradient_reductions"]
    assert grads["overlapped"] >= len(hidden) and grads["overlapped_bytes_per_step"] > 0


def test_v5e8_overlap_runs_the_last_microbatch_after_the_loop(overlap_v5e8):
    # In the TPU schedule of the entry computation, the last microbatch's layer
    # scans (its forward and backward, the entry's other loops) come after the
    # microbatch loop (the one holding loops: its layer scans). Its forward needs
    # nothing from the loop; scheduled before it, what it saves for the backward
    # would stay live across the first N-1 microbatches (deepseek3-small ZeRO-1
    # GA=4: 6.49 GiB per device instead of 6.00). accumulate_gradients ties the
    # last microbatch's input to the loop's accumulator to keep it after.
    module = hlo_tools.parse(overlap_v5e8.compiled.as_text())
    nesting = {
        ctx.loops[0].name
        for contexts in hlo_tools.call_graph(module).contexts.values()
        for ctx in contexts
        if len(ctx.loops) >= 2
    }
    whiles = [i.name for i in module.entry.instructions if i.opcode == "while"]
    loops = [name for name in whiles if name in nesting]
    assert len(loops) == 1 and len(whiles) >= 3, (whiles, nesting)
    assert whiles[0] == loops[0], whiles


def test_v5e8_ring_reduce_scatter_hides_zero1s_reductions(tmp_path):
    # ZeRO-1 + overlap: on v5e every reduce-scatter stays synchronous; as rings of
    # collective-permutes (overlapped_ring) the gradient reductions are async
    # with compute between start and done, and the step still reduces each
    # gradient once (nothing in the microbatch loop).
    config = _config(
        tmp_path,
        **TEST_V5E8,
        shard_optimizer_over_data="true",
        gradient_accumulation_schedule="overlapped_ring",
        tpu_async_collectives="true",
    )
    text = aot.compile_for_topology(config).compiled.as_text()
    hlo_tools.assert_reduced_once_per_step(text)
    rings = [r for r in hlo_tools.async_overlap(text) if hlo_tools.is_ring_reduction(r.collective)]
    assert rings and all(r.is_async for r in rings)
    grads = hlo_tools.overlap_report(text)["gradient_reductions"]
    assert grads["wire_share"] >= 0.9, grads


def test_two_slices_of_v6e4(tmp_path):
    config = _config(
        tmp_path,
        model_name="tagtrain-tiny",
        compile_topology="v6e-4",
        compile_topology_num_slices="2",
        per_device_batch_size="2",
    )
    result = aot.compile_for_topology(config)
    assert result.run.ctx.mesh.size == 8
    slices = [d.slice_index for d in result.run.ctx.mesh.devices.reshape(-1)]
    assert slices == [0] * 4 + [1] * 4  # the data axis spans the slices
    assert result.hlo_path.endswith("aot_v6e-4x2.hlo")
    assert result.memory["total"] < 32 * aot.GIB


def test_671b_layout_on_v5p_is_64_way_experts_and_fsdp_over_the_rest():
    # The aot tier's check of the full DeepSeek-V3 layout on 512 v5p chips without its
    # compile (the slow_aot test below compiles it; the parameter counts:
    # test_671b_with_mtp_counts_its_depth_apart_and_matches_the_model_card).
    config = make_config(
        {**DEEPSEEK3_671B_LAYOUT, "compile_topology": "v5p-1024", "per_device_batch_size": "1"}
    )
    spec = resolve_abstract(config, num_devices=512)
    sizes = {axis: n for axis, n in spec.ctx.mesh.shape.items() if n > 1}
    assert sizes == {"fsdp": 8, "expert": 64}


# About 5 minutes of compile on CI's 2-core host, the aot tier's longest test by far
# (a third of its time): `nox -s slow_aot`; the layout above stays in the tier.
@pytest.mark.slow
def test_671b_on_v5p_compiles_and_fits(tmp_path, capsys):
    # The full DeepSeek-V3 shape on 512 v5p chips: experts over 64-way expert
    # parallelism, the rest FSDP; capped all-to-all blocks and bf16 weights.
    # Measured 80.7 GiB of 95 GiB per device.
    config = _config(
        tmp_path,
        **DEEPSEEK3_671B_LAYOUT,
        compile_topology="v5p-1024",
        per_device_batch_size="1",
    )
    assert aot.main(config) == 0
    out = capsys.readouterr().out
    assert "mesh: fsdp=8, expert=64 (explicit)" in out
    assert re.search(r"params: 6710\d\d\.\d+M total", out), out[:2000]
    total = float(re.search(r"total\s+([\d.]+) GiB of 95 GiB HBM \([\d.]+%, fits\)", out).group(1))
    assert 10 < total < 95


def test_deepseek2_lite_has_the_model_cards_counts():
    # DeepSeek-V2-Lite's published config (YaRN, interleaved rope, q_lora_rank=0,
    # softmax greedy routing): 15.7B total / 2.4B active parameters, as its model
    # card says (active: every matmul weight one token multiplies, logits included:
    # 15,706.5M / 2,451.3M). Counted on the abstract state: no compile.
    from trainer.model import flops

    config = make_config({"model_name": "deepseek2-lite"})
    spec = resolve_abstract(config)
    params, _ = model_lib.abstract_state(spec.model, spec.ctx)
    assert 15_650e6 <= flops.count_params(params) < 15_750e6
    assert 2_400e6 <= flops.active_matmul_params(config.model) < 2_500e6


@pytest.mark.slow  # about 5 minutes of compile on an idle 2-core host: `nox -s slow_aot`
def test_deepseek2_lite_compiles_and_fits_v5p16(tmp_path, capsys):
    # Compiled for 8 v5p chips, FSDP: the startup counts and a step that fits HBM.
    config = _config(
        tmp_path,
        model_name="deepseek2-lite",
        compile_topology="v5p-16",
        ici_data_parallelism="1",
        ici_fsdp_parallelism="-1",
        weight_dtype="bfloat16",
        per_device_batch_size="1",
    )
    assert aot.main(config) == 0
    out = capsys.readouterr().out
    total, active = re.search(r"params: ([\d.]+)M total, ([\d.]+)M active", out).groups()
    assert 15_650 <= float(total) < 15_750, out[:2000]
    assert 2_400 <= float(active) < 2_500, out[:2000]
    assert re.search(r"total\s+[\d.]+ GiB of 95 GiB HBM \([\d.]+%, fits\)", out), out[:4000]


def test_671b_with_mtp_counts_its_depth_apart_and_matches_the_model_card():
    """DeepSeek-V3's card: 671B main model + 14B MTP module = 685B tensors. The
    checkpoint's MTP layer also stores copies of the embedding and the output head;
    here those are the main model's own (shared), so they are counted once."""
    from trainer.model import flops
    from trainer.run import report

    config = make_config({"model_name": "deepseek3-671b", "mtp_num_layers": "1"})
    spec = resolve_abstract(config)
    params, _ = model_lib.abstract_state(spec.model, spec.ctx)
    total, mtp = flops.count_params(params), flops.mtp_param_count(params)
    assert 671.0e9 < total - mtp < 671.1e9  # the main model, as without MTP
    assert 11.5e9 < mtp < 11.7e9  # one MoE block of the 671b shape, eh_proj, 3 norms
    copies = 2 * config.vocab_size * config.emb_dim  # layer 61's embed_tokens, shared_head.head
    assert abs(total + copies - 685e9) / 685e9 < 0.002
    line = report.params_line_of(config.model, params)
    assert f"multi-token prediction: {mtp / 1e6:.3f}M in 1 depth" in line
    # FLOPs / MFU: per token, one more projection, MoE block (top-8 + shared expert)
    # and head pass, and one more layer of attention products.
    c, plain = config, make_config({"model_name": "deepseek3-671b"})
    d, h, v = c.emb_dim, c.base_num_query_heads, c.v_head_dim
    attention = (
        d * c.q_lora_rank
        + c.q_lora_rank * h * c.qk_head_dim
        + d * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank * h * (c.qk_nope_head_dim + v)
        + h * v * d
    )
    moe = d * c.num_experts + 3 * d * c.base_moe_mlp_dim * (c.num_experts_per_tok + 1)
    added = 2 * d * d + attention + moe + d * c.vocab_size
    assert flops.active_matmul_params(c.model) - flops.active_matmul_params(plain.model) == added
    extra_flops = flops.training_flops_per_token(c.model, c.data) - flops.training_flops_per_token(
        plain.model, plain.data
    )
    assert extra_flops == 6 * added + 6 * c.max_target_length * h * (c.qk_head_dim + v)


def test_671b_fsdp_only_reports_that_it_does_not_fit(tmp_path, capsys):
    # FSDP alone gathers each MoE layer's 256 experts whole: XLA refuses, and
    # the report says so with XLA's figures instead of crashing. An explicit policy:
    # under auto, a refused policy gives way to the next one, and when none fits
    # the run stops with one ConfigError naming XLA's refusal for each
    # (test_reduction_choice).
    config = _config(
        tmp_path,
        model_name="deepseek3-671b",
        compile_topology="v5p-1024",
        ici_data_parallelism="1",
        ici_fsdp_parallelism="-1",
        per_device_batch_size="1",
        gradient_reduction_policy="deferred",
    )
    assert aot.main(config) != 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT on v5p-1024 (95 GiB HBM per chip)" in out
    assert "RESOURCE_EXHAUSTED" in out and "exceeds available HBM" in out


def test_v5e8_per_microbatch_reduction_is_caught(tmp_path):
    # The same check fails when the gradients are reduced inside the loop.
    config = _config(tmp_path, **TEST_V5E8, gradient_reduction_policy="per_microbatch")
    text = aot.compile_for_topology(config).compiled.as_text()
    with pytest.raises(AssertionError, match="inside a loop"):
        hlo_tools.assert_reduced_once_per_step(text)
