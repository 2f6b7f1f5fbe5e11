"""Logical axis rules -> mesh specs, across meshes with absent and size-one axes."""

import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pspec_tags as pt

RULES = [
    ("activation_batch", ("data", "fsdp", "expert")),
    ("embed", "fsdp"),
    ("embed", "context"),
    ("mlp", "tensor"),
    ("heads", ("tensor", "missing_axis")),
    ("norm", None),
]


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


@pytest.fixture(scope="module")
def mesh_df():
    return _mesh((2, 4), ("data", "fsdp"))


def test_maps_and_skips_absent_axes(mesh_df):
    spec = pt.logical_to_spec(("activation_batch", None, "mlp"), RULES, mesh_df)
    # 'expert' and 'tensor' are not in this mesh: dropped, not an error.
    assert spec == P(("data", "fsdp"), None, None)


def test_axis_used_by_earlier_dim_falls_to_next_rule():
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "context"))
    spec = pt.logical_to_spec(("activation_batch", "embed"), RULES, mesh)
    assert spec == P(("data", "fsdp"), "context")


def test_size_one_axes_are_dropped():
    mesh = _mesh((8, 1), ("data", "tensor"))
    assert pt.logical_to_spec(("mlp", "heads", "norm"), RULES, mesh) == P(None, None, None)


def test_accepts_mapping_rules(mesh_df):
    assert pt.logical_to_spec(("embed", "mlp"), {"embed": "fsdp", "mlp": None}, mesh_df) == P(
        "fsdp", None
    )


def test_unknown_logical_axis_named(mesh_df):
    with pytest.raises(ValueError, match="'embd' has no rule"):
        pt.logical_to_spec(("embd",), RULES, mesh_df)


def test_batch_mesh_axes(mesh_df):
    assert pt.batch_mesh_axes(mesh_df, RULES) == ("data", "fsdp")
    assert pt.batch_mesh_axes(_mesh((8,), ("tensor",)), RULES) == ()
