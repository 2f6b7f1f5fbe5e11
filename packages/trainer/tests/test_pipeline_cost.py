"""What auto's cost model adds for pipeline stages (step/pipeline_cost.py), on abstract
meshes (nothing compiles). That its permute bytes are the compiled program's is
checked in test_pipeline.py (the v5e-8 compile, and each CPU layout)."""

import pytest

from accum import cost as cost_lib
from trainer.config import make_config
from trainer.model import flops
from trainer.run import spec

# tagtrain-tiny with 1 dense + 4 MoE layers, 4 microbatches (test_pipeline.py's model).
MODEL = {
    "model_name": "tagtrain-tiny",
    "base_num_decoder_layers": "5",
    "gradient_accumulation_steps": "4",
    "compile_topology": "v5p-16",
}
TWO_STAGES = {"ici_pipeline_parallelism": "2", "ici_data_parallelism": "4"}


def staged(devices: int = 8, slices: int = 1, **keys: str):
    """auto's choice for MODEL + keys on an abstract mesh."""
    overrides = {**MODEL, "compile_topology_num_slices": str(slices), **keys}
    return spec.resolve_abstract(make_config(overrides), devices * slices, slices).choice


def test_no_stages_no_pipeline_terms():
    assert staged(ici_data_parallelism="8").pipeline is None


def test_bubble_and_layers_on_every_stage_raise_compute():
    choice = staged(**TWO_STAGES)
    pipe = choice.pipeline
    assert (pipe.stages, pipe.microbatches, pipe.repeats) == (2, 4, 1)
    assert pipe.bubble == pytest.approx(1 / 5)
    config = make_config(MODEL)
    whole = flops.training_flops_per_token(config.model, config.data)
    moe = flops.pipelined_flops_per_token(config.model, config.data)
    assert 0 < moe < whole
    # Stage chips run 1/p of the MoE layers on p x the tokens for (m+p-1)/m of the time,
    # and everything else on p x the tokens.
    expected = pipe.unstaged_compute_seconds * (moe * 5 / 4 + 2 * (whole - moe)) / whole
    assert pipe.compute_seconds == pytest.approx(expected)
    # The deferred row prices that compute and adds the hops, all exposed.
    deferred = choice.costs["deferred"]
    assert deferred.compute_seconds == pytest.approx(pipe.compute_seconds)
    assert deferred.step_seconds == pytest.approx(
        deferred.compute_seconds + deferred.exposed_seconds
    )
    assert deferred.exposed_seconds >= pipe.wire_seconds > 0


def test_uneven_stages_pay_for_their_padding_slots():
    # 3 MoE layers over 2 stages: 2 chunks of 2 slots, one padding slot that runs too.
    keys = {**TWO_STAGES, "base_num_decoder_layers": "4"}
    pipe = staged(**keys).pipeline
    config = make_config({**MODEL, **keys})
    whole = flops.training_flops_per_token(config.model, config.data)
    moe = flops.pipelined_flops_per_token(config.model, config.data)
    expected = pipe.unstaged_compute_seconds * (moe * 4 / 3 * 5 / 4 + 2 * (whole - moe)) / whole
    assert pipe.compute_seconds == pytest.approx(expected)


def test_more_microbatches_shrink_the_bubble_not_the_bytes_per_hop():
    four = staged(**TWO_STAGES).pipeline
    eight = staged(**TWO_STAGES, gradient_accumulation_steps="8").pipeline
    assert eight.bubble < four.bubble
    # Twice the microbatches of the same size (GA doubles the step's batch): each hop
    # carries the same bytes, over 8 + 1 iterations instead of 4 + 1.
    assert four.permute_bytes_in_loop * 9 == eight.permute_bytes_in_loop * 5


def test_circular_stages_relayout_once_per_step():
    gpipe = staged(**TWO_STAGES).pipeline
    circular = staged(**TWO_STAGES, num_pipeline_repeats="2").pipeline
    assert circular.bubble < gpipe.bubble
    # GPipe's outside bytes are the last hop each way; circular adds the chunks' trips.
    assert circular.permute_bytes_outside > gpipe.permute_bytes_outside


def test_stages_across_slices_hop_over_dcn():
    inside = staged(**TWO_STAGES).pipeline
    across = staged(slices=2, dcn_pipeline_parallelism="2", ici_data_parallelism="8").pipeline
    assert inside.link == cost_lib.ICI and across.link == cost_lib.DCN
    # DCN is slower per byte: the same hop bytes take longer.
    per_byte = {p.link: p.wire_seconds / p.link_bytes for p in (inside, across)}
    assert per_byte[cost_lib.DCN] > per_byte[cost_lib.ICI]
