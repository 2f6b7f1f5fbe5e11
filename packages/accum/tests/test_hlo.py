"""Compiled placement of the gradient reduction (hlo_tools), and compiled memory."""

import jax
import numpy as np
import pytest

import accum
import hlo_tools as ht

N = 4


def _compiled(setup, defer):
    policy = "deferred" if defer else "per_microbatch"

    def build():
        def fn(params, batch):
            plan = accum.plan_for(params, batch, policy=policy)
            return accum.accumulate_gradients(
                setup.model.loss_fn, params, batch, num_microbatches=N, plan=plan
            )

        return jax.jit(fn).lower(setup.params, setup.batch).compile()

    # The key test_accumulate's _accumulated uses too: one compile for both.
    return setup.cached(("accumulate", N, policy), build)


def _peak(compiled):
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - (m.alias_size_in_bytes)
    )


def _per_device_elements(params):
    return sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(params))


def _reduction_bytes(text, side):
    rows = ht.traffic(ht.parse(text))[side]
    return sum(rows[k]["bytes_per_step"] for k in ht.REDUCTION_KINDS if k in rows)


def test_deferred_reduces_once_per_step(get_setup):
    setup = get_setup("data8")
    text = _compiled(setup, True).as_text()
    outside = ht.assert_reduced_once_per_step(text, max_in_loop_elements=8)
    # Every gradient is reduced outside the loop: the reductions there cover at
    # least each device's share of every parameter (beyond hlo_tools' guard).
    assert sum(c.elements for c in outside) >= _per_device_elements(setup.params)


def test_per_microbatch_reduction_is_caught(get_setup):
    setup = get_setup("data8")
    text = _compiled(setup, False).as_text()
    with pytest.raises(AssertionError, match="inside a loop"):
        ht.assert_reduced_once_per_step(text, max_in_loop_elements=8)
    inside, _ = ht.split_by_entry_loop(text)
    assert max(ht.cross_replica_all_reduce_sizes(inside)) > 8


def test_deferral_moves_traffic_out_of_the_loop(get_setup):
    setup = get_setup("data8")
    tagged, untagged = _compiled(setup, True).as_text(), _compiled(setup, False).as_text()
    # Per microbatch and per layer before; scalars only (loss, weight) after.
    assert _reduction_bytes(untagged, "in_loop") >= N * 4 * _per_device_elements(setup.params)
    assert _reduction_bytes(tagged, "in_loop") <= N * 8 * 4
    assert _reduction_bytes(tagged, "outside") >= 4 * _per_device_elements(setup.params)


def test_deferral_does_not_raise_compiled_memory(get_setup):
    setup = get_setup("data8")
    deferred, per_microbatch = _peak(_compiled(setup, True)), _peak(_compiled(setup, False))
    assert deferred <= 1.02 * per_microbatch, (deferred, per_microbatch)


def _data_coordinate(mesh):
    """device id -> its index along the mesh's 'data' axis."""
    axis = mesh.axis_names.index("data")
    coords = {}
    for index, device in np.ndenumerate(mesh.devices):
        coords[device.id] = index[axis]
    return coords


def _spans_data(c, coords):
    assert c.replica_groups is not None, c
    return any(len({coords[d] for d in group}) > 1 for group in c.replica_groups)


@pytest.mark.parametrize("defer", [True, False])
def test_expert_mesh_reduces_over_data_once_per_step(get_setup, defer):
    # The soft-MoE combine all-reduces activations over 'expert' in the loop
    # (inherent to that layer); what deferral guarantees is that no reduction
    # inside the loop spans the 'data' axis, and the gradients' does outside.
    setup = get_setup("data2_expert4")
    text = _compiled(setup, defer).as_text()
    coords = _data_coordinate(setup.mesh)
    in_loop = ht.in_loop_reductions(text, max_in_loop_elements=8)
    assert in_loop, "expected the expert-axis activation reductions (test premise)"
    over_data = [c.op_name for c in in_loop if _spans_data(c, coords)]
    if not defer:  # the negative case: per-microbatch gradient reductions over data
        assert over_data
        return
    assert not over_data
    outside = ht.gradient_reductions_outside(text, max_in_loop_elements=8)
    reduced = sum(c.elements for c in outside if _spans_data(c, coords))
    assert reduced >= _per_device_elements(setup.params)
