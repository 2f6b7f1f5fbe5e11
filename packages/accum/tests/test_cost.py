"""accum.cost over hand-sized plans: bytes per axis per event kind, the time model's
formulas, accumulator memory, and the hardware table's refusals. Nothing compiles
(the byte predictions are checked against compiled programs in the trainer's aot
tier: test_aot_matrix.py, test_aot_slices.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
from accum import cost
from accum.hardware import HARDWARE, HardwareError, hardware

SIZES = {"dcn_data": 2, "data": 2, "fsdp": 2}
GA = 4


def _params():
    """A replicated weight (64 x 32), one FSDP-sharded (64 x 32 over fsdp), a bias of 8
    elements (at the MIN_ELEMENTS cut: left out) on 2 x (data=2, fsdp=2) devices."""
    mesh = jax.make_mesh(tuple(SIZES.values()), tuple(SIZES))

    def leaf(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return {
        "w": leaf((64, 32), P()),
        "fsdp_w": leaf((64, 32), P("fsdp", None)),
        "bias": leaf((8,), P()),
    }


def _predict(policy, hw=None, **kwargs):
    params = _params()
    plan = accum.make_plan(
        params,
        batch_axes=tuple(SIZES),
        mesh_shape=SIZES,
        policy=policy,
        slice_axes=("dcn_data",),
    )
    args = dict(num_microbatches=GA, hardware=hw or hardware("v5p"), step_flops_per_chip=1e12)
    return cost.predict(plan, params, **{**args, **kwargs})


W, FSDP_W = 64 * 32, 64 * 32 // 2  # local elements


def test_bytes_per_axis_per_policy():
    deferred = _predict("deferred")
    # Once per step, f32: w over every batch axis, fsdp_w over the non-fsdp ones
    # (FSDP reduces its own axis per use: not counted); the 8-element bias left out.
    assert deferred.bytes_in_loop == {"dcn_data": 0, "data": 0, "fsdp": 0}
    # Across slices, the in-slice shard of each (XLA reduce-scatters in the slice first).
    assert deferred.bytes_outside == {
        "dcn_data": 4 * (W // 4 + FSDP_W // 2),
        "data": 4 * (W + FSDP_W),
        "fsdp": 4 * W,
    }
    per_mb = _predict("per_microbatch")
    # Per microbatch, bf16 (autodiff reduces the compute-dtype cotangent), GA times.
    assert per_mb.bytes_in_loop == {a: GA * n // 2 for a, n in deferred.bytes_outside.items()}
    assert per_mb.bytes_outside == {"dcn_data": 0, "data": 0, "fsdp": 0}
    hier = _predict("hierarchical")
    # In-slice axes scattered per microbatch (bf16); across slices once per step, f32,
    # the accumulator scattered over data and fsdp (w) or data (fsdp_w, already on fsdp).
    assert hier.bytes_in_loop == {
        "dcn_data": 0,
        "data": GA * 2 * (W + FSDP_W),
        "fsdp": GA * 2 * W,
    }
    assert hier.bytes_outside == {"dcn_data": 4 * (W // 4 + FSDP_W // 2), "data": 0, "fsdp": 0}
    # The bias: data takes its one free dimension, fsdp finds none left.
    assert hier.accumulator_bytes == 4 * (W // 4 + FSDP_W // 2 + 8 // 2)
    assert deferred.accumulator_bytes == per_mb.accumulator_bytes == 4 * (W + FSDP_W + 8)


def test_gradient_dtypes_and_small_cross_slice_shards():
    # A leaf the model uses uncast (here w, in f32) reduces an f32 cotangent per
    # microbatch: twice the bf16 bytes; None keeps the compute dtype.
    mixed = _predict(
        "per_microbatch", gradient_dtypes={"w": "float32", "fsdp_w": None, "bias": None}
    )
    plain = _predict("per_microbatch")
    assert mixed.bytes_in_loop["fsdp"] == 2 * plain.bytes_in_loop["fsdp"] == GA * 4 * W
    # A leaf cast to bf16 and up to f32 again at its use (the router's gate): its
    # per-microbatch reduction carries f32; the scatters (accum's, on the bf16
    # gradient) and the once-per-step f32 accumulator do not change.
    up = {"w": "float32", "fsdp_w": None, "bias": None}
    assert _predict("per_microbatch", use_dtypes=up).bytes_in_loop == mixed.bytes_in_loop
    # Gathered over fsdp, then cast up: reduced over the other axes at the gathered
    # size, before the reduce-scatter (XLA does not reorder them across the cast).
    gathered_up = _predict(
        "per_microbatch", use_dtypes={"w": None, "fsdp_w": "float32", "bias": None}
    )
    extra = GA * (4 * FSDP_W * 2 - 2 * FSDP_W)  # f32 at the gathered size, not bf16 at the shard
    assert gathered_up.bytes_in_loop["data"] == plain.bytes_in_loop["data"] + extra
    assert gathered_up.bytes_in_loop["dcn_data"] == plain.bytes_in_loop["dcn_data"] + extra // 2

    for policy in ("hierarchical", "deferred"):
        cast_up = _predict(policy, use_dtypes=up)
        assert cast_up.bytes_in_loop == _predict(policy).bytes_in_loop
        assert cast_up.bytes_outside == _predict(policy).bytes_outside


def test_a_copy_summed_in_its_use_is_reduced_whole_over_every_batch_axis():
    # The embedding's lookup: a shard_map psums the cotangent of the copy it reads,
    # gathered over fsdp, over every batch axis at once; the sum is then sliced.
    params = _params()
    plan = accum.make_plan(
        params, batch_axes=tuple(SIZES), mesh_shape=SIZES, policy="per_microbatch"
    )
    kw = dict(num_microbatches=GA, compute_dtype="float32", accum_dtype="float32")
    summed = {"w": True, "fsdp_w": True, "bias": False}
    # One event per leaf, in the tree's key order (the 8-element bias has none).
    fsdp_w, w = cost.plan_events(plan, params, **kw)
    fsdp_w_whole, w_whole = cost.plan_events(plan, params, summed_in_use=summed, **kw)
    # w is not gathered: the same event. fsdp_w: over fsdp too, at its gathered size.
    assert w_whole == w and not w.sliced
    assert fsdp_w.axes == ("dcn_data", "data") and fsdp_w.nbytes == 4 * FSDP_W
    assert fsdp_w_whole.axes == ("dcn_data", "data", "fsdp") and fsdp_w_whole.nbytes == 4 * W
    assert fsdp_w_whole.sliced and fsdp_w_whole.times == GA and fsdp_w_whole.in_loop
    # A 32-element f32 matrix over data and dcn_data: 16 elements cross the slices, 8
    # with data=4; at 8 hlo_tools' filter drops the array, and so does the model.
    sizes = {"dcn_data": 2, "data": 4}
    event = cost.Event(("dcn_data", "data"), 32 * 4, 1, False, False, 4)
    inside, outside = cost.bytes_per_axis([event], tuple(sizes), sizes, ("dcn_data",))
    assert outside == {"dcn_data": 0, "data": 32 * 4}
    sizes["data"] = 2
    inside, outside = cost.bytes_per_axis([event], tuple(sizes), sizes, ("dcn_data",))
    assert outside == {"dcn_data": 16 * 4, "data": 32 * 4}


def _crossing(shape, policy, sizes, **kwargs):
    """(in-loop, after-loop) dcn_data bytes per step of one f32 leaf of `shape`."""
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes))
    params = {"x": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))}
    plan = accum.make_plan(
        params, batch_axes=tuple(sizes), mesh_shape=sizes, policy=policy, slice_axes=("dcn_data",)
    )
    kw = dict(num_microbatches=GA, compute_dtype="float32", accum_dtype="float32")
    events = cost.plan_events(plan, params, **kw, **kwargs)
    inside, outside = cost.bytes_per_axis(events, tuple(sizes), sizes, ("dcn_data",))
    return inside["dcn_data"], outside["dcn_data"]


def test_small_vectors_and_rows_cross_slices_whole():
    # XLA:TPU sends a vector of at most VECTOR_TILE elements per in-slice device, or
    # a row of at most ROW_TILE, across slices whole; a longer one, or any array of
    # two or more rows, as its in-slice shard (data=4 here).
    sizes = {"dcn_data": 2, "data": 4}
    n, row = 4 * cost.VECTOR_TILE, 4 * cost.ROW_TILE
    assert _crossing((n,), "per_microbatch", sizes) == (GA * 4 * n, 0)
    assert _crossing((n + 128,), "per_microbatch", sizes) == (GA * (n + 128), 0)
    assert _crossing((1, row), "per_microbatch", sizes) == (GA * 4 * row, 0)
    assert _crossing((1, 2 * row), "per_microbatch", sizes) == (GA * 2 * row, 0)
    assert _crossing((2, 128), "per_microbatch", sizes) == (GA * 4 * 256 // 4, 0)
    # A stack of 3 layers is reduced a layer at a time: 3 vectors of 256, whole.
    stacked = {"x": True}
    assert _crossing((3, 256), "per_microbatch", sizes, stacked_per_layer=stacked) == (
        GA * 4 * 768,
        0,
    )
    # Its accumulator, reduced once after the loop, has 3 rows: the shard.
    assert _crossing((3, 256), "deferred", sizes, stacked_per_layer=stacked) == (0, 4 * 768 // 4)
    # A vector accumulator crosses whole, unless ZeRO-1 slices the sum to each
    # device's shard: then XLA reduce-scatters it inside the slice first.
    assert _crossing((256,), "deferred", sizes) == (0, 4 * 256)
    assert _crossing((256,), "deferred", sizes, zero1=True) == (0, 4 * 256 // 4)
    # The per-microbatch reductions of a vector XLA moves after the loop stay whole.
    moved = _crossing((256,), "per_microbatch", sizes, summed_by_the_loop={"x": True}, zero1=True)
    assert moved == (0, 4 * 256)


def test_leaves_the_loop_only_sums_are_reduced_once_after_it():
    # XLA's loop all-reduce code motion: w's per-microbatch reductions leave the
    # loop, once on the summed gradients; fsdp_w (say, stacked by a layer scan) stays.
    moves = {"w": True, "fsdp_w": False, "bias": True}
    per_mb = _predict("per_microbatch")
    moved = _predict("per_microbatch", summed_by_the_loop=moves)
    # An all-reduce keeps its in-loop dtype (bf16) after the loop.
    in_loop = {"dcn_data": GA * 2 * FSDP_W // 2, "data": GA * 2 * FSDP_W, "fsdp": 0}
    assert moved.bytes_in_loop == in_loop
    assert moved.bytes_in_loop["data"] < per_mb.bytes_in_loop["data"]
    assert moved.bytes_outside == {"dcn_data": 2 * W // 4, "data": 2 * W, "fsdp": 2 * W}
    assert moved.step_seconds < per_mb.step_seconds
    # A reduce-scatter (hierarchical's) runs on the summed accumulator, in f32.
    hier = _predict("hierarchical")
    hier_moved = _predict("hierarchical", summed_by_the_loop=moves)
    assert hier_moved.bytes_in_loop == {"dcn_data": 0, "data": GA * 2 * FSDP_W, "fsdp": 0}
    assert hier_moved.bytes_outside == {
        "dcn_data": hier.bytes_outside["dcn_data"],
        "data": 4 * W,
        "fsdp": 4 * W,
    }
    # Deferred reduces nothing in the loop: nothing moves.
    assert _predict("deferred", summed_by_the_loop=moves) == _predict("deferred")
    # A gathered copy's sum is sliced before the loop adds it: it stays.
    params = _params()
    plan = accum.make_plan(
        params, batch_axes=tuple(SIZES), mesh_shape=SIZES, policy="per_microbatch"
    )
    kw = dict(num_microbatches=GA, compute_dtype="float32", accum_dtype="float32")
    summed = {"w": False, "fsdp_w": True, "bias": False}
    everything = {"w": True, "fsdp_w": True, "bias": True}
    fsdp_w, w = cost.plan_events(
        plan, params, summed_in_use=summed, summed_by_the_loop=everything, **kw
    )
    assert fsdp_w.sliced and fsdp_w.in_loop and fsdp_w.times == GA
    assert not w.in_loop and w.times == 1 and w.nbytes == 4 * W


def test_time_model_formulas():
    hw = hardware("v5p")
    c = _predict("deferred", hw)
    # One after-loop all-reduce per leaf: w over (data, fsdp) in the slice (g=4),
    # fsdp_w over data (g=2); across the 2 slices each on its in-slice shard.
    ici = 2 * 3 / 4 * 4 * W / hw.ici_bytes_per_s + 2 * 1 / 2 * 4 * FSDP_W / hw.ici_bytes_per_s
    dcn = (2 * 1 / 2 * 4 * W / 4 + 2 * 1 / 2 * 4 * FSDP_W / 2) / hw.dcn_bytes_per_s
    assert c.link_seconds["ICI"] == pytest.approx(ici)
    assert c.link_seconds["DCN"] == pytest.approx(dcn)
    assert c.compute_seconds == pytest.approx(1e12 / hw.peak_flops)
    assert c.exposed_seconds == pytest.approx(ici + dcn) and c.hidden_seconds == 0
    assert c.step_seconds == pytest.approx(c.compute_seconds + ici + dcn)
    assert c.dcn_share == pytest.approx(dcn / c.step_seconds)
    # Overlapped after the loop: hidden up to the last microbatch's backward (2/3 of
    # its compute), here all of it.
    hidden = _predict("deferred", hw, overlapped_after_loop=True)
    assert hidden.hidden_seconds == pytest.approx(ici + dcn)
    assert hidden.step_seconds == pytest.approx(c.compute_seconds)


def test_across_slices_per_microbatch_costs_more_dcn_than_hierarchical():
    for chip in ("v5e", "v5p", "v6e"):
        per_mb, hier = (
            _predict("per_microbatch", hardware(chip)),
            _predict("hierarchical", hardware(chip)),
        )
        assert per_mb.link_seconds["DCN"] > hier.link_seconds["DCN"]
        assert per_mb.step_seconds > hier.step_seconds


def test_hardware_table_refuses_unknown_and_incomplete_entries():
    assert hardware("v5p-16") is HARDWARE["v5p"]
    with pytest.raises(HardwareError, match=r"no hardware table entry for 'tpu7'; known: v4, v5e"):
        hardware("tpu7")
    # Every chip of the table has every figure (each one's source: docs/cost_model.md).
    assert all(not hardware(chip).missing() for chip in HARDWARE)
    unlinked = {
        "v4": dataclasses.replace(HARDWARE["v4"], ici_bytes_per_s=None, dcn_bytes_per_s=None)
    }
    with pytest.raises(HardwareError, match=r"'v4' lacks ici_bytes_per_s, dcn_bytes_per_s"):
        hardware("v4", unlinked)
    partial = {"x": dataclasses.replace(HARDWARE["v5e"], name="x", peak_flops=None)}
    with pytest.raises(HardwareError, match=r"'x' lacks peak_flops .*HARDWARE\['x'\]"):
        hardware("x", partial)
