"""Expert parallelism across slices (dcn_expert_parallelism > 1) on 8 CPU devices
emulating 2 slices x 4.

One 'expert' mesh axis of 4 = 2 slices x 2 devices (its cross-slice part major),
beside data=2 inside each slice: each slice is one block of the devices and holds
half of the expert axis' indices, the MoE all-to-all crosses the slices, and the
step (tagtrain-tiny, f32, GA=2) trains as the single-slice layout of the same sizes
(ici_expert=4 x ici_data=2) does, every gradient still reduced once per step.
"""

import jax
import numpy as np
import pytest

import accum
import hlo_tools

# 2 slices: the expert axis' cross-slice part is 2, the batch is not split across them.
DCN_EXPERT = dict(
    num_slices="2",
    dcn_data_parallelism="1",
    dcn_expert_parallelism="2",
    ici_expert_parallelism="2",
    ici_data_parallelism="2",
    gradient_accumulation_steps="2",
)
# The same mesh sizes on one slice.
ONE_SLICE = dict(
    ici_expert_parallelism="4", ici_data_parallelism="2", gradient_accumulation_steps="2"
)
MESH = {"data": 2, "expert": 4}  # the trainer's mesh, size-one axes left out


def _config(overrides):
    from trainer.config import make_config

    return make_config({"model_name": "tagtrain-tiny", "dtype": "float32", **overrides})


def test_each_slice_is_one_block_and_holds_half_the_expert_axis():
    from trainer.config import MESH_AXES, dcn_parts, mesh_shape
    from trainer.sharding import make_mesh, slices

    config = _config(DCN_EXPERT)
    sizes, dcn = mesh_shape(config, 8, 2), dcn_parts(config, 8, 2)
    assert {a: n for a, n in sizes.items() if n > 1} == MESH
    assert dcn == {"stage": 1, "expert": 2}
    mesh = make_mesh(sizes, "explicit", jax.devices(), dcn)
    devices = np.moveaxis(mesh.devices, MESH_AXES.index("expert"), 0).reshape(4, -1)
    per_slice = len(jax.devices()) // 2
    # Expert indices 0, 1 in slice 0 (devices 0-3), 2, 3 in slice 1 (devices 4-7).
    assert [{d.id // per_slice for d in row} for row in devices] == [{0}, {0}, {1}, {1}]
    assert slices.slice_of(mesh.devices, 2) == [d.id // per_slice for d in mesh.devices.flat]
    # The expert axis counts among the cross-slice token axes; inside a slice it does not.
    assert slices.slice_axes(sizes, dcn) == ("expert",)
    one = _config(ONE_SLICE)
    assert slices.slice_axes(mesh_shape(one, 8), dcn_parts(one, 8)) == ()
    # -1 fills the slices, as the other dcn_ keys do.
    filled = _config({**DCN_EXPERT, "dcn_expert_parallelism": "-1"})
    assert dcn_parts(filled, 8, 2)["expert"] == 2 and mesh_shape(filled, 8, 2) == sizes


def test_the_plan_takes_the_expert_axis_for_a_cross_slice_one():
    """hierarchical needs a cross-slice batch axis: the expert axis is one (deferred
    whole, its in-slice part with it); data is reduce-scattered per microbatch."""
    from trainer.run.spec import resolve_abstract

    spec = resolve_abstract(
        _config({**DCN_EXPERT, "gradient_reduction_policy": "hierarchical"}), 8, 2
    )
    plan = spec.plan
    assert plan.slice_axes == ("expert",)
    # A leaf not sharded over expert (the embedding): expert once per step, data
    # scattered per microbatch; the experts' own kernels reduce expert per use.
    whens = {dict(leaf.when)["expert"] for leaf in plan.leaf_plans()}
    assert whens == {accum.PER_STEP, accum.PER_USE}
    assert {dict(leaf.when)["data"] for leaf in plan.leaf_plans()} == {accum.SCATTER}


# Slow tier (two compiles, ~40 s of the cpu tier's 15 minutes): the cpu tier keeps the
# cross-slice layout's HLO and plan checks above, and data+expert's numbers
# (test_parallelism.py).
@pytest.mark.slow
def test_same_numbers_as_the_one_slice_layout(runner, grads_runner, grads_match):
    want = runner(1, **ONE_SLICE)[0][0]
    got = runner(1, **DCN_EXPERT)[0][0]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)
    grads_match(grads_runner(1, **DCN_EXPERT), grads_runner(1, **ONE_SLICE), rtol=1e-5)


def test_all_to_all_crosses_slices_and_gradients_reduce_once_per_step(runner):
    from trainer.config import MESH_AXES, dcn_parts, mesh_shape
    from trainer.run import report
    from trainer.sharding import make_mesh, slices

    _, text = runner(1, **DCN_EXPERT)
    config = _config(DCN_EXPERT)
    sizes = mesh_shape(config, 8, 2)
    mesh = make_mesh(sizes, "explicit", jax.devices(), dcn_parts(config, 8, 2))
    where = slices.slice_of(mesh.devices, 2)
    assert [a for a in MESH_AXES if sizes[a] > 1] == list(MESH)
    records = hlo_tools.collectives(text)
    moves = [c for c in records if c.kind == "all-to-all"]
    assert moves and all(hlo_tools.crosses_slices(c, 8, 2, where) for c in moves)
    # On the plain slice blocks (ids in mesh order) some of them would look in-slice:
    # the mesh order is not slice by slice here.
    assert not all(hlo_tools.crosses_slices(c, 8, 2) for c in moves)
    judged = hlo_tools.verdict(hlo_tools.parse(text), mesh_shape=MESH, over=("data", "expert"))
    assert judged["status"] == "OK", judged
    split = hlo_tools.slice_traffic(text, 2, 8, where)
    gradients = [c for c in hlo_tools.gradient_reductions_outside(hlo_tools.parse(text))]
    assert gradients and any(hlo_tools.crosses_slices(c, 8, 2, where) for c in gradients)
    assert split["cross_slice"]["outside"] > 0
    # The startup summary splits by each device's slice (run.summary_axes gives it);
    # without it, it leaves out the split its id blocks would get wrong.
    lines = report.collective_summary(text, config.accumulation, MESH, (), ("expert",), where)
    assert "  " + hlo_tools.format_slice_traffic(split) in lines
    lines = report.collective_summary(text, config.accumulation, MESH, (), ("expert",))
    assert "  cross-slice / in-slice split not given: the expert axis crosses slices" in lines


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"dcn_data_parallelism": "-1", "dcn_expert_parallelism": "-1"},
            r"^only one dcn_\*_parallelism may be -1; got -1 for dcn_data_parallelism, "
            r"dcn_expert_parallelism$",
        ),
        (
            {"dcn_data_parallelism": "1", "dcn_expert_parallelism": "4"},
            r"^the dcn_\*_parallelism keys multiply to 4 \(dcn_expert_parallelism=4\) but "
            r"there are 2 slices",
        ),
    ],
)
def test_bad_dcn_expert_configs_stop_before_compiling(overrides, message):
    from trainer.config import ConfigError
    from trainer.config.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(_config({"num_slices": "2", **overrides}), 8, 2)


@pytest.mark.slow  # one more compile of the tiny model
def test_hierarchical_defers_the_whole_expert_axis_with_the_same_numbers(
    runner, grads_runner, grads_match
):
    """gradient_reduction_policy=hierarchical: the cross-slice expert axis reduced once
    per step (its in-slice part too), data scattered per microbatch; the numbers are
    the one-slice layout's."""
    hierarchical = {**DCN_EXPERT, "gradient_reduction_policy": "hierarchical"}
    want = runner(1, **ONE_SLICE)[0][0]
    got, text = runner(1, **hierarchical)
    np.testing.assert_allclose(got[0]["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got[0]["grad_norm"], want["grad_norm"], rtol=1e-5)
    grads_match(grads_runner(1, **hierarchical), grads_runner(1, **ONE_SLICE), rtol=1e-5)
    judged = hlo_tools.verdict(hlo_tools.parse(text), mesh_shape=MESH, over=("expert",))
    assert judged["status"] == "OK", judged
    scatters = [c for c in hlo_tools.collectives(text) if c.in_loop and c.kind == "reduce-scatter"]
    assert scatters and all(hlo_tools.spanned_axes([c], MESH) == ("data",) for c in scatters)
