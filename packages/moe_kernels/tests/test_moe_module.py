"""The NNX `MoE` module: logical axis metadata, sparse/dense switch, bias update, meshes."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_kernels import MoE, MoEConfig, RoutingBias

CFG = MoEConfig(num_experts=8, num_experts_per_tok=2, mlp_dim=8, num_shared_experts=1)


def test_logical_axes_metadata():
    model = MoE(CFG, 16, rngs=nnx.Rngs(0))
    names = nnx.get_partition_spec(nnx.state(model))
    assert names["wi_0"] == P("exp", "embed", "mlp")
    assert names["wo"] == P("exp", "mlp", "embed")
    assert names["gate"] == P("embed", None)
    assert isinstance(model.bias, RoutingBias)
    # The optimizer sees only nnx.Param; the routing bias is not among them.
    assert "bias" not in nnx.state(model, nnx.Param)


def test_sparse_and_dense_switch_agree_and_bias_is_not_trained():
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    sparse = MoE(CFG, 16, rngs=nnx.Rngs(0), sparse=True)
    dense = MoE(CFG, 16, rngs=nnx.Rngs(0), sparse=False)
    ys, ss = sparse(x)
    yd, sd = dense(x)
    np.testing.assert_allclose(ys, yd, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ss["tokens_per_expert"], sd["tokens_per_expert"])
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(sparse)
    assert "bias" not in grads and "wi_0" in grads


def test_update_bias_from_stats():
    model = MoE(CFG, 16, rngs=nnx.Rngs(0))
    _, stats = model(jax.random.normal(jax.random.key(1), (2, 6, 16)))
    counts = np.asarray(stats["tokens_per_expert"])
    model.update_bias(stats["tokens_per_expert"], rate=0.01)
    bias = np.asarray(model.bias[...])
    np.testing.assert_allclose(bias, 0.01 * np.sign(counts.mean() - counts), rtol=1e-6)


def test_placed_on_an_explicit_mesh_under_jit(mesh_factory):
    mesh = mesh_factory(4)
    x = jax.random.normal(jax.random.key(1), (8, 2, 16))
    reference = MoE(CFG, 16, rngs=nnx.Rngs(0))
    y0, _ = reference(x)
    with jax.set_mesh(mesh):
        model = MoE(CFG, 16, rngs=nnx.Rngs(0), mesh=mesh)
        assert model.wi_0[...].sharding.spec == P("expert", None, None)
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
        y, stats = nnx.jit(lambda m, x: m(x))(model, xs)
        assert jax.typeof(y).sharding.spec == P(("data", "expert"), None, None)
    np.testing.assert_allclose(jax.device_get(y), y0, rtol=1e-5, atol=1e-6)
