"""The hierarchical reduction plan on 8 CPU devices emulating 2 slices x 4.

tagtrain-tiny, f32, GA=4, ZeRO-1: the loss and spot-checked gradients equal a
single-device run (rtol 1e-4); in the compiled step no gradient reduction crosses
the slice axis inside the microbatch loop, the in-slice reduce-scatters run once
per microbatch, and the one cross-slice reduction after the loop moves 1x the
(ZeRO-1 sharded) gradient.
"""

import jax
import numpy as np
import pytest

import hlo_tools

SLICES = dict(
    num_slices="2",
    gradient_reduction_policy="hierarchical",
    shard_optimizer_over_data="true",
    gradient_accumulation_steps="4",
)
MESH = {"dcn_data": 2, "data": 4}  # the trainer's mesh, size-one axes left out
GA = 4


def _reductions(text):
    return [
        c
        for c in hlo_tools.collectives(text)
        if c.kind in hlo_tools.REDUCTION_KINDS and c.cross_replica and c.elements > 8
    ]


def test_hierarchical_matches_single_device(runner, grads_runner, grads_match):
    ref = runner(1, devices=1)[0][0]
    first = runner(1, **SLICES)[0][0]
    np.testing.assert_allclose(first["loss"], ref["loss"], rtol=1e-4)
    np.testing.assert_allclose(first["grad_norm"], ref["grad_norm"], rtol=1e-4)
    want_grads = grads_runner(1, devices=1)
    grads = grads_runner(1, **SLICES)
    grads_match(grads, want_grads, rtol=1e-4)


def test_no_cross_slice_reduction_in_the_loop_and_in_slice_scatters_per_microbatch(runner):
    # Unfused: one reduce-scatter of the whole gradient after each microbatch's
    # backward pass (fused accumulation, the default, scatters each layer inside
    # it: test_hierarchical_fused_matches_and_keeps_cross_slice_out_of_the_loop).
    _, text = runner(1, **SLICES, gradient_accumulation_schedule="plain")
    reductions = _reductions(text)
    inside = [c for c in reductions if c.in_loop]
    assert not [c for c in inside if hlo_tools.spans_mesh_axis(c, MESH, "dcn_data")]
    assert not [c for c in inside if hlo_tools.crosses_slices(c, 8, 2)]
    scatters = [c for c in inside if c.kind == "reduce-scatter"]
    assert scatters, "the in-slice reduction must be a reduce-scatter per microbatch"
    for c in scatters:
        assert hlo_tools.spanned_axes([c], MESH) == ("data",)
        assert c.multiplier == GA, c.loop_path  # once per microbatch, not per layer
    # The verdict the startup summary prints agrees.
    judged = hlo_tools.verdict(hlo_tools.parse(text), mesh_shape=MESH, over=("dcn_data",))
    assert judged["status"] == "OK" and judged["allowed_in_loop"] >= len(scatters)


def test_one_cross_slice_reduction_of_the_sharded_gradient_per_step(runner):
    from trainer.config import make_config
    from trainer.run import run as run_lib

    _, text = runner(1, **SLICES)
    split = hlo_tools.slice_traffic(text, 2)
    assert split["cross_slice"]["in_loop"] == 0 and split["in_slice"]["in_loop"] > 0
    across = [c for c in _reductions(text) if hlo_tools.crosses_slices(c, 8, 2)]
    config = make_config({"model_name": "tagtrain-tiny", "dtype": "float32", **SLICES})
    run = run_lib.abstract_setup(config, jax.devices())
    params = sum(x.size for x in jax.tree.leaves(run.state["params"]))
    # Each device reduces its ZeRO-1 shard (1/4 of the gradient) across the slices, once.
    shard_elements = sum(c.elements * (c.multiplier or 1) for c in across)
    assert params / 4 <= shard_elements <= params / 4 * 1.05


def test_startup_lines_name_the_plan(runner):
    from trainer.config import make_config
    from trainer.run import run as run_lib

    config = make_config({"model_name": "tagtrain-tiny", **SLICES, "print_reduction_plan": "true"})
    run = run_lib.abstract_setup(config, jax.devices())
    assert run.plan.strict_axes == ("dcn_data",) and run.plan.slice_axes == ("dcn_data",)
    lines = run_lib.report.plan_lines(config.accumulation, run.plan)
    assert lines[0].startswith("gradient reduction: hierarchical: once per step over ('dcn_data',)")
    assert lines[2].split() == ["parameters", "dcn_data", "data"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_slices": "2", "dcn_data_parallelism": "4"}, r"dcn_data_parallelism=4"),
        ({"num_slices": "3"}, r"num_slices=3 does not divide"),
        (
            {"num_slices": "2", "dcn_data_parallelism": "1", "dcn_fsdp_parallelism": "2",
             "shard_optimizer_over_data": "true"},
            r"dcn_fsdp_parallelism=2",
        ),
    ],
)  # fmt: skip
def test_bad_slice_configs_stop_before_compiling(overrides, message):
    from trainer.config import ConfigError, make_config
    from trainer.config.validate import validate

    config = make_config(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(config, 8, config.num_slices if config.num_slices > 0 else 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"gradient_reduction_policy": "hierarchical"},
            r"^gradient_reduction_policy=hierarchical with shard_mode=explicit, "
            r"dcn_data_parallelism=1, dcn_fsdp_parallelism=1 \(the cross-slice axes: num_slices, "
            r"or compile_topology_num_slices, > 1\): the hierarchical policy needs a cross-slice "
            r"batch axis .*cross-slice axes: none$",
        ),
        (
            {"num_slices": "2", "gradient_reduction_policy": "hierarchical", "shard_mode": "auto"},
            r"^gradient_reduction_policy=hierarchical with shard_mode=auto, dcn_data_parallelism=2"
            r".*: the hierarchical policy needs explicit mode \(mode='auto' lets XLA place",
        ),
    ],
)  # fmt: skip
def test_a_policy_accum_refuses_stops_before_building(overrides, message):
    """accum.make_plan's rules, refused where the plan is made (run.spec.resolve)."""
    from trainer.config import ConfigError, make_config
    from trainer.run.spec import resolve

    with pytest.raises(ConfigError, match=message):
        resolve(make_config(overrides), jax.devices())


def test_slice_count_from_devices_config_and_topology():
    import types

    from trainer.config import ConfigError, make_config
    from trainer.sharding import slices

    real = [types.SimpleNamespace(id=i, slice_index=i // 4) for i in range(8)]
    assert slices.num_slices(make_config({}), real) == 2  # detected on real slices
    assert slices.num_slices(make_config({}), jax.devices()) == 1  # CPU: one slice
    assert slices.num_slices(make_config({"num_slices": "2"}), jax.devices()) == 2  # emulated
    with pytest.raises(ConfigError, match="num_slices=4 but the devices span 2 slices"):
        slices.num_slices(make_config({"num_slices": "4"}), real)
    aot = make_config({"compile_topology": "v5e-8", "compile_topology_num_slices": "2"})
    assert slices.num_slices(aot, jax.devices()) == 2
    with pytest.raises(ConfigError, match="contradicts compile_topology_num_slices=2"):
        slices.num_slices(make_config({**aot.__dict__, "num_slices": 3}), jax.devices())
    assert [d.id for d in slices.slice_major(real[::-1])] == list(range(8))


def test_devices_that_report_slices_get_one_slice_per_dcn_block(monkeypatch):
    """slices.device_array: devices with a slice_index go through MaxText's hybrid
    mesh (grouped by slice, whatever their order); CPU devices, which report none,
    keep the order given. The TPU layout inside a slice: test_aot_slices.py."""
    import types

    from trainer.config import MESH_AXES
    from trainer.sharding import slices

    fake = [types.SimpleNamespace(id=i, slice_index=i % 2, device_kind="cpu", platform="cpu")
            for i in range(8)]  # fmt: skip
    array = slices.device_array({"dcn_data": 2, "data": 4}, fake)
    # One dimension per mesh axis, in MESH_AXES order (the stage axis leads).
    sizes = {"dcn_data": 2, "data": 4}
    assert array.shape == tuple(sizes.get(axis, 1) for axis in MESH_AXES)
    by_slice = np.moveaxis(array, MESH_AXES.index("dcn_data"), 0)
    assert [[d.id for d in by_slice[i].flat] for i in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    cpu = slices.device_array({"dcn_data": 2, "data": 4}, jax.devices())
    assert [d.id for d in cpu.flat] == [d.id for d in jax.devices()]

    # A layout the hybrid mesh refuses falls back to the order given, saying why.
    def refuse(*args, **kwargs):
        raise NotImplementedError("no such torus")

    monkeypatch.setattr(slices.mesh_utils, "create_hybrid_device_mesh", refuse)
    with pytest.warns(UserWarning, match=r"hybrid device mesh .* refused \(no such torus\)"):
        array = slices.device_array({"dcn_data": 2, "data": 4}, fake)
    assert [d.id for d in array.flat] == list(range(8))


def test_hierarchical_fused_matches_and_keeps_cross_slice_out_of_the_loop(
    runner, grads_runner, grads_match
):
    """gradient_accumulation_schedule=fused reduce-scatters each layer's in-slice partial
    sums inside the backward layer scan: same numbers as unfused hierarchical, and
    still no cross-slice reduction in any loop."""
    fused = {**SLICES, "gradient_accumulation_schedule": "fused"}
    unfused = {**SLICES, "gradient_accumulation_schedule": "plain"}
    want = runner(1, **unfused)[0][0]
    got, text = runner(1, **fused)
    np.testing.assert_allclose(got[0]["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got[0]["grad_norm"], want["grad_norm"], rtol=1e-5)
    want_grads, grads = grads_runner(1, **unfused), grads_runner(1, **fused)
    grads_match(grads, want_grads, rtol=1e-5)
    judged = hlo_tools.verdict(hlo_tools.parse(text), mesh_shape=MESH, over=("dcn_data",))
    assert judged["status"] == "OK", judged["message"]
    assert hlo_tools.slice_traffic(text, 2)["cross_slice"]["in_loop"] == 0
    # The in-slice reduce-scatters run per layer inside the backward layer scan:
    # GA x the scanned layers' trip count, not once per microbatch.
    scatters = [c for c in _reductions(text) if c.in_loop and c.kind == "reduce-scatter"]
    assert all(c.multiplier % GA == 0 for c in scatters)
    assert max(c.multiplier for c in scatters) > GA
