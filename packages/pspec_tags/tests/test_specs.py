"""Spec algebra: every function keeps tags and reads entries through `.partitions`."""

import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pspec_tags as pt

UNC = P.UNCONSTRAINED


@pytest.fixture(scope="module")
def mesh():
    # data=2, fsdp=4, tensor=1: `tensor` is a size-one axis on purpose.
    return jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)


TAGGED = P(("fsdp", "tensor"), None, reduced={"data"})
UNTAGGED = P(("fsdp", "tensor"), None)


def test_tagged_spec_refuses_iteration_so_helpers_must_not_iterate():
    # The premise of the package: if JAX ever stops refusing, the tests below still
    # check tags are kept, but this documents why `.partitions` is used everywhere.
    with pytest.raises(ValueError, match="dangerous"):
        tuple(TAGGED)


@pytest.mark.parametrize("spec", [TAGGED, UNTAGGED])
def test_partitions_and_tags(spec):
    assert pt.partitions(spec) == (("fsdp", "tensor"), None)
    assert pt.mesh_axes_used(spec) == ("fsdp", "tensor")
    assert pt.reduced_axes(spec) == (frozenset({"data"}) if spec is TAGGED else frozenset())
    assert pt.unreduced_axes(spec) == frozenset()


def test_none_spec():
    assert pt.partitions(None) == ()
    assert pt.reduced_axes(None) == frozenset()
    assert pt.mesh_axes_used(None) == ()
    assert pt.untagged(None) == P()
    assert pt.truncate(None, 2) is None
    assert pt.with_reduced(None, {"data"}) == P(reduced={"data"})


def test_with_and_without_tags():
    spec = pt.with_unreduced(pt.with_reduced(P("fsdp"), {"data"}), {"tensor"})
    assert pt.reduced_axes(spec) == {"data"}
    assert pt.unreduced_axes(spec) == {"tensor"}
    assert pt.partitions(spec) == ("fsdp",)
    assert pt.untagged(spec) == P("fsdp")
    assert pt.reduced_axes(pt.untagged(spec)) == frozenset()


@pytest.mark.parametrize("adder", [pt.with_reduced, pt.with_unreduced])
def test_tag_overlapping_partitions_names_spec_and_axis(adder):
    with pytest.raises(ValueError, match=r"'fsdp'.*P\(\('fsdp', 'tensor'\), None\)"):
        adder(UNTAGGED, {"fsdp"})


def test_reduced_and_unreduced_on_same_axis_rejected():
    with pytest.raises(ValueError, match="'data'.*both reduced and unreduced"):
        pt.with_unreduced(P(None, reduced={"data"}), {"data"})


@pytest.mark.parametrize("tag", [{}, {"reduced": {"data"}}, {"unreduced": {"data"}}])
def test_remove_size_one_mesh_axes_keeps_tags(mesh, tag):
    spec = P(("fsdp", "tensor"), None, UNC, **tag)
    out = pt.remove_size_one_mesh_axes(spec, mesh)
    assert out.partitions == ("fsdp", None, UNC)
    assert pt.remove_size_one_mesh_axes(P("tensor", "fsdp", **tag), mesh).partitions == (
        None,
        "fsdp",
    )
    assert pt.reduced_axes(out) == pt.reduced_axes(spec)
    assert pt.unreduced_axes(out) == pt.unreduced_axes(spec)
    assert pt.remove_size_one_mesh_axes(None, mesh) is None


@pytest.mark.parametrize("tag", [{}, {"reduced": {"tensor"}}])
def test_fit_to_shape_drops_axes_that_do_not_divide(mesh, tag):
    spec = P(("data", "fsdp"), None, **tag)
    # 8 takes data*fsdp; 6 takes data only (2 divides, 8 does not); 3 takes nothing.
    for dim, want in ((8, ("data", "fsdp")), (6, "data"), (3, None)):
        out = pt.fit_to_shape(spec, (dim, 5), mesh)
        assert out.partitions == (want, None)
        assert pt.reduced_axes(out) == pt.reduced_axes(spec)


def test_fit_to_shape_passes_unconstrained_and_shorter_specs(mesh):
    out = pt.fit_to_shape(P(UNC, reduced={"data"}), (7, 3), mesh)
    assert out.partitions == (UNC,)
    assert pt.reduced_axes(out) == {"data"}


def test_truncate_keeps_tags():
    spec = P("data", "fsdp", None, unreduced={"tensor"})
    out = pt.truncate(spec, 2)
    assert out.partitions == ("data", "fsdp")
    assert pt.unreduced_axes(out) == {"tensor"}
    assert pt.truncate(spec, 5).partitions == spec.partitions


def test_bad_spec_rank_names_spec(mesh):
    with pytest.raises(ValueError, match=r"P\('data', None, None\).*3 entries.*rank 2"):
        pt.fit_to_shape(P("data", None, None), (4, 4), mesh)


def test_axis_not_in_mesh_names_spec_and_axis(mesh):
    with pytest.raises(ValueError, match=r"'expert'.*not in the mesh"):
        pt.remove_size_one_mesh_axes(P("expert", None), mesh)
    with pytest.raises(ValueError, match=r"'expert'.*not in the mesh"):
        pt.check_spec(P(None, reduced={"expert"}), mesh=mesh)


def test_axis_used_twice_rejected(mesh):
    with pytest.raises(ValueError, match="'data' for more than one dimension"):
        pt.check_spec(P("data", ("fsdp", "data")), mesh=mesh)
