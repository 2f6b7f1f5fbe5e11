"""Fixtures for moe_kernels tests: meshes over the 8 virtual CPU devices."""

import jax
import pytest
from jax.sharding import AxisType


def make_mesh(ep: int, fsdp: int = 1, explicit: bool = True):
    """(data, fsdp, expert) mesh over all 8 devices; data takes what is left."""
    n = len(jax.devices())
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(
        (n // (ep * fsdp), fsdp, ep), ("data", "fsdp", "expert"), axis_types=(kind,) * 3
    )


@pytest.fixture(scope="session")
def mesh_factory():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (the root conftest sets 8 virtual CPU devices)")
    return make_mesh
