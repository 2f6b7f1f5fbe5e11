"""TPU AOT: a reduced-tag gradient step compiled for v5e:2x4 on this CPU host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pspec_tags as pt

pytestmark = pytest.mark.aot


@pytest.fixture(scope="module")
def compiled():
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("v5e:2x4", "tpu")
    devices = np.array(topo.devices).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)

    def loss(w_DxF, x_BxD):
        return jnp.sum(jnp.tanh(x_BxD @ w_DxF))

    def step(w_DxF, x_BxD):
        w_red = jax.reshard(w_DxF, pt.with_reduced(pt.spec_of(w_DxF), {"data"}))
        g_unreduced = jax.grad(loss)(w_red, x_BxD)
        # Resharding onto the untagged spec is the one all-reduce over 'data'.
        return g_unreduced, jax.reshard(g_unreduced, pt.untagged(pt.spec_of(g_unreduced)))

    with jax.set_mesh(mesh):
        w = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
        x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        return jax.jit(step).lower(w, x).compile()


def test_compiled_output_shardings_are_what_was_asked(compiled):
    unreduced_out, reduced_out = compiled.output_shardings
    assert pt.partitions(unreduced_out.spec)[:1] == ("fsdp",)
    assert pt.unreduced_axes(unreduced_out.spec) == {"data"}
    assert pt.partitions(reduced_out.spec)[:1] == ("fsdp",)
    assert pt.unreduced_axes(reduced_out.spec) == frozenset()


def test_tpu_hlo_reduces_gradient_over_data_groups(compiled):
    text = compiled.as_text()
    data_groups = "replica_groups={{0,2,4,6},{1,3,5,7}}"
    reductions = [line for line in text.splitlines() if " all-reduce(" in line]
    assert any(data_groups in line and "f32[64,128]" in line for line in reductions), reductions
