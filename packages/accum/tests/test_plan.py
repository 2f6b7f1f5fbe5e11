"""The reduction plan over a table of layouts: per parameter leaf and batch axis, when
its gradient is reduced, for each policy. Pure spec arithmetic: nothing compiles."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
from accum import BY_XLA, PER_MICROBATCH, PER_STEP, PER_USE, SCATTER

STEP, MB, USE, RS = PER_STEP, PER_MICROBATCH, PER_USE, SCATTER

# Layout -> (mesh axes and sizes, outermost first; batch axes; slice axes). The
# trainer's convention: cross-slice axes are their own outermost mesh axes.
LAYOUTS = {
    "data": ({"data": 8}, ("data",), ()),
    "fsdp": ({"fsdp": 8}, ("fsdp",), ()),
    "data+fsdp": ({"data": 4, "fsdp": 2}, ("data", "fsdp"), ()),
    "data+zero1": ({"data": 8}, ("data",), ()),
    "expert": ({"data": 4, "expert": 2}, ("data", "expert"), ()),
}
LAYOUTS.update(
    {
        f"2 slices x {name}": (
            {"dcn_data": 2, **{a: n // 2 if i == 0 else n for i, (a, n) in enumerate(m.items())}},
            ("dcn_data", *batch),
            ("dcn_data",),
        )
        for name, (m, batch, _) in list(LAYOUTS.items())
    }
)


def _params(sizes):
    """A replicated weight, one sharded over fsdp (FSDP's embed dim) and stacked
    experts sharded over expert: the three kinds of leaf the trainer has."""
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes))
    fsdp = "fsdp" if sizes.get("fsdp", 1) > 1 else None
    expert = "expert" if sizes.get("expert", 1) > 1 else None

    def leaf(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return {
        "w": leaf((16, 32), P()),
        "fsdp_w": leaf((16, 32), P(fsdp, None)),
        "experts": leaf((8, 16, 32), P(expert, None, None)),
    }


def _schedule(name, policy):
    sizes, batch, slices = LAYOUTS[name]
    plan = accum.make_plan(
        _params(sizes), batch_axes=batch, mesh_shape=sizes, policy=policy, slice_axes=slices
    )
    return plan, {k: dict(leaf.when) for k, leaf in plan.leaves.items()}


# (layout, policy) -> {leaf: {axis: when}} for the axes listed (others as noted).
EXPECTED = {
    ("data", "deferred"): {"w": {"data": STEP}, "fsdp_w": {"data": STEP}},
    ("data", "per_microbatch"): {"w": {"data": MB}},
    ("fsdp", "deferred"): {"w": {"fsdp": STEP}, "fsdp_w": {"fsdp": USE}},
    ("data+fsdp", "deferred"): {
        "w": {"data": STEP, "fsdp": STEP},
        "fsdp_w": {"data": STEP, "fsdp": USE},
    },
    ("data+zero1", "deferred"): {"w": {"data": STEP}},
    ("expert", "deferred"): {
        "w": {"data": STEP, "expert": STEP},
        "experts": {"data": STEP, "expert": USE},
    },
    ("2 slices x data", "deferred"): {"w": {"dcn_data": STEP, "data": STEP}},
    ("2 slices x data", "per_microbatch"): {"w": {"dcn_data": MB, "data": MB}},
    ("2 slices x data", "hierarchical"): {"w": {"dcn_data": STEP, "data": RS}},
    ("2 slices x data+zero1", "hierarchical"): {"w": {"dcn_data": STEP, "data": RS}},
    ("2 slices x fsdp", "hierarchical"): {
        "w": {"dcn_data": STEP, "fsdp": RS},
        "fsdp_w": {"dcn_data": STEP, "fsdp": USE},
    },
    ("2 slices x data+fsdp", "hierarchical"): {
        "w": {"dcn_data": STEP, "data": RS, "fsdp": RS},
        "fsdp_w": {"dcn_data": STEP, "data": RS, "fsdp": USE},
    },
    ("2 slices x expert", "hierarchical"): {
        "w": {"dcn_data": STEP, "data": RS, "expert": RS},
        "experts": {"dcn_data": STEP, "data": RS, "expert": USE},
    },
}


@pytest.mark.parametrize(("name", "policy"), list(EXPECTED), ids=[" ".join(k) for k in EXPECTED])
def test_schedule_table(name, policy):
    _, schedule = _schedule(name, policy)
    for leaf, want in EXPECTED[(name, policy)].items():
        assert schedule[leaf] == want, (leaf, schedule[leaf])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_batch_axis_gets_a_time_under_every_policy(name):
    for policy in accum.POLICIES:
        if policy == "hierarchical" and "slices" not in name:
            continue
        plan, schedule = _schedule(name, policy)
        for when in schedule.values():
            assert tuple(when) == plan.batch_axes
        # A leaf sharded over an axis always reduces it per use, whatever the policy.
        assert schedule["fsdp_w"].get("fsdp", USE) == USE


def test_strict_axes_are_those_every_leaf_defers():
    assert _schedule("data", "deferred")[0].strict_axes == ("data",)
    assert _schedule("data+fsdp", "deferred")[0].strict_axes == ("data",)
    assert _schedule("expert", "deferred")[0].strict_axes == ("data",)
    assert _schedule("fsdp", "deferred")[0].strict_axes == ()
    assert _schedule("data", "per_microbatch")[0].strict_axes == ()
    assert _schedule("2 slices x data", "hierarchical")[0].strict_axes == ("dcn_data",)


def test_hierarchical_accumulators_are_sharded_like_zero1_and_unreduced_across_slices():
    plan, _ = _schedule("2 slices x data+zero1", "hierarchical")
    sizes = LAYOUTS["2 slices x data+zero1"][0]
    masters = accum.zero1_shardings(_params(sizes))
    for key, leaf in plan.leaves.items():
        assert leaf.accumulator_spec == masters[key].spec, key
        assert leaf.accumulator_target.unreduced == frozenset({"dcn_data"})
    assert plan.scatters and plan.deferred_axes == ("dcn_data",)


def test_auto_mode_leaves_everything_to_xla():
    sizes, batch, _ = LAYOUTS["data"]
    plan = accum.make_plan(_params(sizes), batch_axes=batch, mesh_shape=sizes, mode="auto")
    assert {w for leaf in plan.leaf_plans() for _, w in leaf.when} == {BY_XLA}
    assert plan.tagged_axes == () and "XLA" in plan.summary()


def test_fused_accumulation_applies_unless_autodiff_reduces_per_microbatch():
    def plan(sizes, batch, **kw):
        return accum.make_plan(_params(sizes), batch_axes=batch, mesh_shape=sizes, **kw)

    sizes, batch, _ = LAYOUTS["data"]
    assert plan(sizes, batch).fused_applies
    assert plan(sizes, batch, mode="auto").fused_applies
    # Autodiff reduces every gradient inside the backward: fusing would let
    # XLA:TPU move those reductions onto a full-size gradient.
    assert not plan(sizes, batch, policy="per_microbatch").fused_applies
    # No batch axis to reduce (one device): fusing only saves memory.
    assert plan({"data": 1}, ("data",), policy="per_microbatch").fused_applies
    # Hierarchical scatters per microbatch into sharded accumulators: fused.
    sizes, batch, slices = LAYOUTS["2 slices x data"]
    assert plan(sizes, batch, policy="hierarchical", slice_axes=slices).fused_applies


@pytest.mark.parametrize(
    "schedule,policy,microbatches,scans_layers,fuses",
    [
        ("fused", "deferred", 4, True, True),
        ("fused", "deferred", None, True, True),  # add: one of an open count
        ("fused", "deferred", 1, True, False),  # nothing to accumulate
        ("fused", "per_microbatch", 4, True, False),  # not fused_applies
        ("fused", "deferred", 4, False, False),  # no layer scan to fuse into
        ("plain", "deferred", 4, True, False),
        ("overlapped", "per_microbatch", 1, True, True),  # it reduces in the scan
        ("overlapped_ring", "deferred", 4, True, True),
        ("overlapped", "deferred", 4, False, False),
    ],
)
def test_fuses_in_scan_is_the_one_decision(schedule, policy, microbatches, scans_layers, fuses):
    sizes, batch, _ = LAYOUTS["data"]
    plan = accum.make_plan(_params(sizes), batch_axes=batch, mesh_shape=sizes, policy=policy)
    got = accum.fuses_in_scan(schedule, plan, microbatches, scans_layers=scans_layers)
    assert got is fuses


def test_global_gating_reduces_a_weight_sharded_axis_per_microbatch_for_all():
    sizes, batch, _ = LAYOUTS["data+fsdp"]
    plan = accum.make_plan(_params(sizes), batch_axes=batch, mesh_shape=sizes, per_parameter=False)
    assert plan.leaves["w"].when == (("data", STEP), ("fsdp", MB))
    assert accum.deferred_axes(_params(sizes), batch) == ("data",)


def test_bad_policies_are_plan_errors():
    sizes, batch, _ = LAYOUTS["data"]
    with pytest.raises(accum.PlanError, match="cross-slice"):
        accum.make_plan(_params(sizes), batch_axes=batch, mesh_shape=sizes, policy="hierarchical")
    with pytest.raises(accum.PlanError, match="not one of"):
        accum.make_plan(_params(sizes), batch_axes=batch, mesh_shape=sizes, policy="sometimes")


def test_hierarchical_needs_explicit_mode_and_a_cross_slice_batch_axis():
    sizes, batch, slices = LAYOUTS["2 slices x data"]
    with pytest.raises(accum.PlanError, match=r"needs explicit mode \(mode='auto' lets XLA"):
        accum.make_plan(
            _params(sizes), batch_axes=batch, mesh_shape=sizes, policy="hierarchical",
            mode="auto", slice_axes=slices,
        )  # fmt: skip
    # A slice axis that does not shard the batch is no cross-slice batch axis.
    with pytest.raises(
        accum.PlanError,
        match=r"batch axes here: \('data',\), cross-slice axes: \('dcn_data',\)$",
    ):
        accum.make_plan(
            _params(sizes), batch_axes=("data",), mesh_shape=sizes, policy="hierarchical",
            slice_axes=slices,
        )  # fmt: skip


def test_table_prints_groups_by_axes():
    plan, _ = _schedule("2 slices x data", "hierarchical")
    table = plan.table()
    assert table[0].split() == ["parameters", "dcn_data", "data"]
    assert any(row.startswith("w ") and "once per step" in row and SCATTER in row for row in table)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_gathered_copy_is_tagged_as_the_plan_says(name):
    """reduced_at_use (ShardCtx's tag on a weight gathered over the batch axes) is
    the plan read at the use: the axes accum reduces (tagged) plus the per-use ones;
    a leaf accum does not tag (all its axes per use) is left to JAX untagged."""
    for policy in ("deferred", "hierarchical"):
        if policy == "hierarchical" and "slices" not in name:
            continue
        plan, _ = _schedule(name, policy)
        for key, leaf in plan.leaves.items():
            source = P(*leaf.param_spec, reduced=set(leaf.tagged))
            gathered = P(*[None] * len(leaf.param_spec))  # every batch axis gathered
            want = set(leaf.tagged) | set(leaf.axes(USE)) if leaf.tagged else set()
            assert accum.reduced_at_use(source, gathered, plan.batch_axes) == want, key
            # Nothing gathered: the tag stays the parameter's own.
            assert accum.reduced_at_use(source, source, plan.batch_axes) == set(leaf.tagged)
    assert accum.reduced_at_use(P("fsdp"), P(None), ("fsdp",)) == frozenset()  # untagged
