"""Issue 7's matrix, explicit mode: each parallelism layout equals one device.

tagtrain-tiny in f32, one step: the loss and spot-checked gradient leaves (Adam's
first moment after one step) match a single-device run; with GA=4 and a batch-only
'data' axis, explicit mode keeps every gradient reduction out of the entry loop.
"""

import re

import pytest

import hlo_tools
from trainer.config import make_config
from trainer.run.report import collective_summary

# The layouts whose only batch axis is 'data' run at GA=4 (the same 32 sequences per
# step as the single-device reference): one compile per layout serves both the
# equality check and the deferral check below.
GA4 = {"gradient_accumulation_steps": "4"}
DEFERRED_GA4 = ("data+expert", "data+zero1")
MATRIX_MODE = "explicit"  # conftest.SLOW_LAYOUTS: the layouts left to the slow tier


def test_explicit_layout_matches_single_device(matrix_layout, check_layout):
    # `matrix_layout` is parametrized over conftest.LAYOUTS; auto mode: test_parallelism_auto.py.
    check_layout(matrix_layout, "explicit", **(GA4 if matrix_layout in DEFERRED_GA4 else {}))


def test_explicit_ga4_keeps_gradient_reductions_out_of_the_loop(ga4_layout, runner, layouts):
    # `ga4_layout`: each of DEFERRED_GA4, slow where its matrix case is (conftest).
    _, text = runner(1, **layouts[ga4_layout], shard_mode="explicit", **GA4)  # check_layout's run
    outside = hlo_tools.assert_reduced_once_per_step(text)
    assert sum(c.elements for c in outside) > 10_000


def test_context_parallel_ga4_matches_single_device_and_is_no_tag_loss(
    check_layout, runner, layouts
):
    """fsdp x context at GA=4 (one sequence per device per microbatch): attention
    reduces its all-gathered keys' and values' cotangents over 'context' every
    microbatch, by construction; on this model they have the shape of the stacked
    wq_b. The verdict reads where each reduced value goes (into the backward dots,
    not the accumulator) and passes the step, whose gradients equal one device's
    (#33: it raised TagLostError here)."""
    check_layout("fsdp+context", "explicit", **GA4)  # compiles: the verdict runs
    _, text = runner(1, **layouts["fsdp+context"], shard_mode="explicit", **GA4)
    mark = re.search(r"accum_microbatch_loop\[([^|\]]*)\|([^\]]*)\]", text)
    assert mark is not None and mark.group(1) == "context"  # the deferred axis
    sizes = {a: int(n) for a, n in (kv.split("=") for kv in mark.group(2).split(","))}
    per_microbatch = [
        c
        for c in hlo_tools.in_loop_reductions(text)  # any loop, > 8 elements
        if hlo_tools.spans_mesh_axis(c, sizes, "context")
    ]
    assert per_microbatch, "the attention cotangents' 'context' reductions are gone"
    assert all("transpose(" in c.op_name for c in per_microbatch)  # backward ones
    # The startup summary reads the same verdict: no FAIL for them.
    config = make_config({**layouts["fsdp+context"], **GA4})
    head = collective_summary(text, config.accumulation, sizes, ("context",))[0]
    assert "OK: no gradient reduction > 8 elements over context inside loops" in head, head
    assert f"{len(per_microbatch)} of them carrying activations" in head, head


def _groups_span_data(collective, data_size: int, devices: int = 8) -> bool:
    # The trainer's mesh: 'data' leading, the other axes folded into one.
    mesh_shape = {"data": data_size, "rest": devices // data_size}
    return hlo_tools.spans_mesh_axis(collective, mesh_shape, "data")


DATA_FSDP = dict(
    ici_data_parallelism="4", ici_fsdp_parallelism="2", gradient_accumulation_steps="4"
)


def test_fsdp_keeps_data_reduction_out_of_the_loop(runner):
    """FSDP reduce-scatters stay per microbatch; the 'data' all-reduce runs once per step."""
    _, text = runner(1, **DATA_FSDP)
    inside = hlo_tools.in_loop_reductions(text)
    assert inside, "FSDP must reduce-scatter each gathered weight's gradient per microbatch"
    assert not [c for c in inside if _groups_span_data(c, 4)], "a 'data' reduction in the loop"
    outside = hlo_tools.gradient_reductions_outside(text)
    assert [c for c in outside if _groups_span_data(c, 4)], "no 'data' reduction after the loop"


def test_fsdp_without_deferral_reduces_data_in_the_loop(runner):
    _, text = runner(1, **DATA_FSDP, gradient_reduction_policy="per_microbatch")
    inside = hlo_tools.in_loop_reductions(text)
    assert [c for c in inside if _groups_span_data(c, 4)]


def test_startup_summary_tells_fsdp_reductions_from_lost_deferral(runner):
    """The per-microbatch FSDP reduce-scatters are expected; a 'data' one in the loop is not."""
    from trainer.config import make_config
    from trainer.run.report import collective_summary

    config = make_config(DATA_FSDP)
    mesh_shape = {"data": 4, "fsdp": 2}
    _, text = runner(1, **DATA_FSDP)
    head = collective_summary(text, config.accumulation, mesh_shape, ("data",))[0]
    want = (
        "OK: no reduction > 8 elements over data inside loops (9 per iteration over fsdp "
        "only, allowed); 4 gradient-sized reduction(s) outside"
    )
    assert head.endswith(want), head
    # Deferral off: the 'data' reductions are in the loop, and a strict summary says so.
    _, per_microbatch = runner(1, **DATA_FSDP, gradient_reduction_policy="per_microbatch")
    head = collective_summary(per_microbatch, config.accumulation, mesh_shape, ("data",))[0]
    assert (
        head.split("; ")[-1].startswith("FAIL: ") and "> 8 elements over data inside loops" in head
    )


@pytest.mark.parametrize(
    ("name", "strict"),
    [("data", ("data",)), ("data+zero1", ("data",)), ("data+fsdp", ("data",)),
     ("fsdp", ()), ("fsdp+context", ("context",)), ("fsdp+expert(fsdp)", ())],
)  # fmt: skip
def test_strict_axes_are_those_sharding_no_weight(name, strict):
    import jax

    from trainer.config import make_config
    from trainer.run import run as run_lib
    from trainer_tests_layouts import EIGHT_DEVICE_LAYOUTS

    config = make_config({"model_name": "tagtrain-tiny", **EIGHT_DEVICE_LAYOUTS[name]})
    run = run_lib.abstract_setup(config, jax.devices())
    assert run.plan.strict_axes == strict
