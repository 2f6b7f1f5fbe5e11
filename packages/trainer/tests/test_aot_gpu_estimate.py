"""The GPU step-time estimate of a real compile: a small model for one H200,
compiled on this CPU host (jax's CUDA plugin), never run.

    JAX_PLATFORMS=cpu uv run --extra tpu --extra gpu pytest -m aot \
        packages/trainer/tests/test_aot_gpu_estimate.py

Structural facts only (no timing is asserted): the totals are the sums of their
parts, the program's matmul FLOPs are the model's (trainer.model.flops) on a dense
model with nothing recomputed, and the AOT report prints the estimate.
"""

import pytest

import hlo_tools
from trainer.config import make_config
from trainer.model import flops
from trainer.run import aot, gpu_estimate, gpu_topology

pytestmark = pytest.mark.aot
pytest.importorskip(gpu_topology.PLUGIN, reason="needs the gpu extra: uv run --extra gpu")

# deepseek3-small's width cut to two dense layers (no experts: their padded blocks
# compute more rows than tokens), nothing recomputed in the backward (remat would add
# forward FLOPs), a short sequence: a compile of a minute or two on this host. Triton
# cannot tile tagtrain-tiny's matmuls for a GPU, so the width stays.
SMALL = dict(
    model_name="deepseek3-small",
    base_num_decoder_layers="2",
    first_num_dense_layers="2",
    per_device_batch_size="2",
    gradient_accumulation_steps="2",
    max_target_length="256",
    remat_policy="none",
    compile_topology="h200-1",
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    config = make_config({"base_output_directory": str(tmp_path_factory.mktemp("est")), **SMALL})
    result = aot.compile_for_topology(config)
    return result, gpu_estimate.estimate(result)


def test_totals_are_the_sums_of_their_parts(compiled):
    result, est = compiled
    assert est.total_ms == pytest.approx(sum(g.ms for g in est.groups))
    assert est.total_ms == pytest.approx(sum(ms for _, _, ms in est.by_category.values()))
    assert [g.ms for g in est.groups] == sorted((g.ms for g in est.groups), reverse=True)
    # Every kernel the thunk sequence launches, each named to its HLO instruction.
    assert est.launches == result.kernels.total
    assert all(k.instruction for k in est.kernels if k.kind != "kCopy")
    assert est.by_category["matmul"][0] >= 2 * 2 * 2  # layers x microbatches x fwd/bwd
    # The model's XLA attention is priced as cuDNN's, from its own source lines.
    assert any("MLA._dot_product" in g.source for g in est.groups)
    assert "attention" in est.by_category


def test_matmul_flops_are_the_models(compiled):
    result, est = compiled
    config = result.run.config
    model = flops.training_flops_per_token(config.model, config.data)
    expected = model * result.run.batch_size * config.max_target_length
    # The formula counts projections, logits and attention's two products, forward and
    # twice backward; the program adds nothing else that is a dot here.
    assert est.flops == pytest.approx(expected, rel=0.03)


def test_report_prints_the_estimate(compiled):
    result, est = compiled
    text = "\n".join(aot.report_lines(result))
    assert f"predicted GPU step: {est.total_ms:,.1f} ms, MFU " in text
    assert "  5 costliest source lines:" in text
    top = est.groups[0]
    assert f"{top.ms:8.1f} ms" in text and top.source in text
    # The kept files read back to the same kernels (hlo-report --gpu reads them).
    hlo, _, _ = hlo_tools.program_files(result.hlo_path)
    assert len(gpu_estimate.kernels_of_files(hlo)) == len(est.kernels)
