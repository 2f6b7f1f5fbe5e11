"""Two v5e-8 slices (`compile_topology_num_slices=2`): tagtrain-test's train step
compiled for them on this CPU host (libtpu from the `tpu` extra), never run; the
hierarchical reduction, accum.cost's bytes against the compiled program's, and the
mesh's slice layout. `uv run --extra tpu pytest -m aot packages/trainer/tests/test_aot_slices.py`.
One slice: test_aot.py."""

import jax
import numpy as np
import pytest

import hlo_tools
from trainer.config import make_config
from trainer.run import aot
from trainer.step import reduction_bytes
from trainer_tests_layouts import AOT_TEST_V5E8

pytestmark = pytest.mark.aot
pytest.importorskip("libtpu", reason="needs the tpu extra (libtpu): uv run --extra tpu")


def _two_v5e8_slices(tmp_path, **overrides):
    """tagtrain-test, GA=4 on 2 x v5e-8 (dcn_data=2 x data=8) with `overrides`,
    compiled: (the AotResult, its parsed program)."""
    config = make_config(
        {
            "base_output_directory": str(tmp_path),
            **AOT_TEST_V5E8,
            "compile_topology_num_slices": "2",
            "dcn_data_parallelism": "2",
            **overrides,
        }
    )
    result = aot.compile_for_topology(config)
    return result, hlo_tools.parse(result.compiled.as_text())


def _two_v5e8_slices_zero1(tmp_path, policy: str):
    """`_two_v5e8_slices` with ZeRO-1 under the gradient reduction `policy`."""
    return _two_v5e8_slices(
        tmp_path, shard_optimizer_over_data="true", gradient_reduction_policy=policy
    )


def test_two_v5e8_slices_hierarchical(tmp_path):
    """tagtrain-test, ZeRO-1, GA=4 on 2 x v5e-8 (dcn_data=2 x data=8), hierarchical:
    nothing crosses the slices inside the loop, the one cross-slice reduction moves
    each device's ZeRO-1 gradient shard once, the in-slice reductions run in every
    microbatch: per layer inside its backward layer scan (fused accumulation, the
    default), so a multiple of GA=4 times per step and more than once per microbatch."""
    result, module = _two_v5e8_slices_zero1(tmp_path, "hierarchical")
    assert dict(result.run.ctx.mesh.shape)["dcn_data"] == 2
    split = hlo_tools.slice_traffic(module, 2)
    assert split["cross_slice"]["in_loop"] == 0 and split["in_slice"]["in_loop"] > 0
    records = hlo_tools.collectives(module)
    across, inside = hlo_tools.split_by_slice(records, 2, module.num_devices)
    params = sum(x.size for x in jax.tree.leaves(result.run.state["params"]))
    shard_bytes = params * 4 / 8
    grad_across = sum(c.bytes for c in across if c.kind in hlo_tools.REDUCTION_KINDS)
    assert shard_bytes <= grad_across <= 1.1 * shard_bytes
    in_loop = [c for c in inside if c.in_loop and c.kind in hlo_tools.REDUCTION_KINDS]
    assert in_loop and all(c.multiplier % 4 == 0 for c in in_loop)
    assert max(c.multiplier for c in in_loop) > 4
    lines = aot.report_lines(result)
    assert any("cross-slice" in line and "(0 B in loops)" in line for line in lines)
    # accum.cost's bytes, byte for byte: across slices nothing in the loop and the
    # scattered accumulators after it (read before ZeroCrop pads them to (8, 128)
    # tiles); inside the slice the per-microbatch scatters, those XLA moves after
    # the loop as one f32 reduction among them (the leaves outside the layer scans,
    # which accum.cost moves too: docs/cost_model.md, "What XLA moves").
    pred_in, pred_out = reduction_bytes.predicted(result.run)
    got_in, got_out = reduction_bytes.counted(module, dict(result.run.ctx.mesh.shape), ["data"])
    assert reduction_bytes.counted_cross_slice(module) == (0, pred_out["dcn_data"])
    assert pred_in["dcn_data"] == 0 and pred_out["dcn_data"] > 0
    assert got_in["data"] == pred_in["data"] > 0
    assert got_out["data"] == pred_out["data"] > 0


def test_two_v5e8_slices_deferred_bytes_equal_the_cost_model(tmp_path):
    """tagtrain-test, ZeRO-1, GA=4 on 2 x v5e-8, deferred: accum.cost's gradient
    bytes equal hlo_tools' count exactly, inside the slice (every 'data' reduction
    after the loop, the ZeRO-1 gathers XLA lowers to all-reduces left out) and across
    slices (each device's in-slice shard once, read before tile padding)."""
    result, module = _two_v5e8_slices_zero1(tmp_path, "deferred")
    pred_in, pred_out = reduction_bytes.predicted(result.run)
    got_in, got_out = reduction_bytes.counted(module, dict(result.run.ctx.mesh.shape), ["data"])
    assert got_in["data"] == pred_in["data"] == 0
    assert got_out["data"] == pred_out["data"] > 0
    assert reduction_bytes.counted_cross_slice(module) == (0, pred_out["dcn_data"])
    assert pred_in["dcn_data"] == 0 and pred_out["dcn_data"] > 0


@pytest.mark.slow
def test_two_v5e8_slices_per_microbatch_bytes_equal_the_cost_model(tmp_path):
    """tagtrain-test, ZeRO-1, GA=4 on 2 x v5e-8, per_microbatch: accum.cost's bytes
    (with the reductions XLA moves after the loop) equal the count, byte for byte,
    inside the slice and across it, where the f32 norm scales (vectors of at most
    1,024 elements per chip) cross whole and every other array as its shard
    (docs/cost_model.md, "Across slices")."""
    result, module = _two_v5e8_slices_zero1(tmp_path, "per_microbatch")
    pred_in, pred_out = reduction_bytes.predicted(result.run)
    got_in, got_out = reduction_bytes.counted(module, dict(result.run.ctx.mesh.shape), ["data"])
    assert got_in["data"] == pred_in["data"] > 0
    assert got_out["data"] == pred_out["data"] > 0
    across = reduction_bytes.counted_cross_slice(module)
    assert across == (pred_in["dcn_data"], pred_out["dcn_data"])
    assert across[0] > 0 and across[1] > 0


# 2 x v5e-8 variants of the ZeRO-1 GA=4 run above, each with its own rule in accum.cost
# (docs/cost_model.md): without ZeRO-1 a vector accumulator crosses the slices whole;
# under the plain schedule XLA keeps hierarchical's reduce-scatters in the loop;
# without the layer scan the stacked leaves' per-layer reductions stay in the loop.
TWO_SLICE_VARIANTS = {
    "deferred-no-zero1": dict(gradient_reduction_policy="deferred"),
    "hierarchical-plain": dict(
        gradient_reduction_policy="hierarchical",
        shard_optimizer_over_data="true",
        gradient_accumulation_schedule="plain",
    ),
    "hierarchical-unscanned": dict(
        gradient_reduction_policy="hierarchical",
        shard_optimizer_over_data="true",
        scan_layers="false",
    ),
    "per_microbatch-unscanned": dict(
        gradient_reduction_policy="per_microbatch",
        shard_optimizer_over_data="true",
        scan_layers="false",
    ),
}
SLOW_VARIANTS = {"hierarchical-unscanned", "per_microbatch-unscanned"}


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_VARIANTS else [])
        for name in TWO_SLICE_VARIANTS
    ],
)
def test_two_v5e8_slices_variants_bytes_equal_the_cost_model(tmp_path, variant):
    result, module = _two_v5e8_slices(tmp_path, **TWO_SLICE_VARIANTS[variant])
    pred_in, pred_out = reduction_bytes.predicted(result.run)
    got_in, got_out = reduction_bytes.counted(module, dict(result.run.ctx.mesh.shape), ["data"])
    assert (got_in["data"], got_out["data"]) == (pred_in["data"], pred_out["data"])
    across = reduction_bytes.counted_cross_slice(module)
    assert across == (pred_in["dcn_data"], pred_out["dcn_data"]) and sum(across) > 0


@pytest.mark.parametrize(
    "sizes",
    [
        {"dcn_data": 2, "data": 8},
        {"dcn_data": 2, "data": 2, "fsdp": 4},
        {"dcn_fsdp": 2, "fsdp": 8},
        # dcn_pipeline_parallelism=2: the stages cross the slices, one slice per stage.
        {"stage": 2, "data": 8},
    ],
    ids=lambda sizes: "x".join(f"{a}{n}" for a, n in sizes.items()),
)
def test_two_v5e8_slices_place_one_slice_per_dcn_block_laid_out_by_ici(sizes):
    """The mesh of 2 x v5e-8 (no compile): each block along the dcn_ axes holds one
    slice's devices, laid out as jax.make_mesh lays out one v5e-8 slice (its ICI
    ring), not in id order."""
    from jax.experimental import topologies

    from trainer.config import DCN_AXES, MESH_AXES, STAGE_AXIS
    from trainer.sharding import make_mesh

    topo = aot.TOPOLOGIES["v5e-8"]
    mesh = make_mesh(sizes, "explicit", aot.devices_for(topo, 2))
    lead = (STAGE_AXIS, *DCN_AXES)  # the axes that may cross slices ('stage' of size 1 here)
    ndcn = len(lead)
    assert MESH_AXES[:ndcn] == lead  # they lead
    ici_shape = mesh.devices.shape[ndcn:]
    one_slice = topologies.get_topology_desc(topo.libtpu_name, "tpu").devices
    want = jax.make_mesh(ici_shape, MESH_AXES[ndcn:], devices=one_slice).devices
    want_coords = [tuple(d.coords) for d in want.flat]
    assert want_coords != [tuple(d.coords) for d in sorted(one_slice, key=lambda d: d.id)]
    seen = set()
    for index in np.ndindex(mesh.devices.shape[:ndcn]):
        block = mesh.devices[index]
        (slice_index,) = {d.slice_index for d in block.flat}
        seen.add(slice_index)
        assert [tuple(d.coords) for d in block.flat] == want_coords
    assert seen == {0, 1}


def test_two_v5e8_slices_split_a_cross_slice_expert_axis_in_halves():
    """dcn_expert_parallelism=2 on 2 x v5e-8 (no compile): the hybrid mesh gives each
    slice a contiguous half of the 'expert' axis (its cross-slice part major), laid
    out inside as jax.make_mesh lays out one slice of the in-slice sizes."""
    from jax.experimental import topologies

    from trainer.config import MESH_AXES, dcn_parts, make_config, mesh_shape
    from trainer.sharding import make_mesh

    config = make_config(
        {"num_slices": "2", "dcn_data_parallelism": "1", "dcn_expert_parallelism": "2",
         "ici_expert_parallelism": "4", "ici_data_parallelism": "2"}
    )  # fmt: skip
    sizes, dcn = mesh_shape(config, 16, 2), dcn_parts(config, 16, 2)
    topo = aot.TOPOLOGIES["v5e-8"]
    mesh = make_mesh(sizes, "explicit", aot.devices_for(topo, 2), dcn)
    expert = np.moveaxis(mesh.devices, MESH_AXES.index("expert"), 0)
    assert expert.shape[0] == 8
    halves = [expert[:4], expert[4:]]
    assert [{d.slice_index for d in half.flat} for half in halves] == [{0}, {1}]
    ici = tuple(
        n if a != "expert" else 4 for a, n in zip(MESH_AXES, mesh.devices.shape, strict=True)
    )
    one_slice = topologies.get_topology_desc(topo.libtpu_name, "tpu").devices
    want = jax.make_mesh(ici, MESH_AXES, devices=one_slice).devices
    for half in halves:
        got = np.moveaxis(half, 0, MESH_AXES.index("expert"))
        assert [tuple(d.coords) for d in got.flat] == [tuple(d.coords) for d in want.flat]
