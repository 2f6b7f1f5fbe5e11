"""LoRA factors on the expert kernels: the layer computes with W + lora_scale x A @ B.

Sharded (data=2, fsdp=2, expert=2) sparse layer with factors against the unsharded
dense reference on the merged kernels: same output, and the factors' gradients are
the merged kernel's gradient pulled back through the product (dA = s gW B^T,
dB = s A^T gW).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_kernels import DEFAULT_RULES, MoEConfig, dense_moe, init_params, param_specs, sparse_moe

D, R, SCALE = 16, 3, 0.5
ADAPTED = ("wi_0", "wo", "shared_wi_1")
CONFIG = MoEConfig(
    num_experts=8, num_experts_per_tok=2, mlp_dim=8, num_shared_experts=1, lora_scale=SCALE
)


def _inputs():
    params = init_params(jax.random.key(0), CONFIG, D)
    keys = iter(jax.random.split(jax.random.key(1), 2 * len(ADAPTED)))
    for name in ADAPTED:
        w = params[name]
        a_shape, b_shape = (*w.shape[:-1], R), (*w.shape[:-2], R, w.shape[-1])
        params[f"{name}_lora_a"] = 0.3 * jax.random.normal(next(keys), a_shape)
        params[f"{name}_lora_b"] = 0.3 * jax.random.normal(next(keys), b_shape)
    x = jax.random.normal(jax.random.key(2), (8, 4, D))
    ct = jax.random.normal(jax.random.key(3), (8, 4, D))
    return params, x, ct


def _merged(params):
    out = {n: w for n, w in params.items() if "_lora_" not in n}
    for name in ADAPTED:
        a, b = params[f"{name}_lora_a"], params[f"{name}_lora_b"]
        out[name] = params[name] + SCALE * jnp.matmul(a, b)
    return out


def _grads(fn, params, x, ct, mesh=None):
    def loss(p):
        y, _ = fn(x, p, config=CONFIG, mesh=mesh)
        return jnp.sum(y * ct), y

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.fixture(scope="module")
def results(mesh_factory):
    params, x, ct = _inputs()
    (_, y_ref), g_merged = _grads(dense_moe, _merged(params), x, ct)
    mesh = mesh_factory(2, 2)
    specs = param_specs(CONFIG, DEFAULT_RULES, mesh, {n: w.shape for n, w in params.items()})
    with jax.set_mesh(mesh):
        placed = {n: jax.device_put(w, NamedSharding(mesh, specs[n])) for n, w in params.items()}
        tokens = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        x, ct = jax.device_put(x, tokens), jax.device_put(ct, tokens)
        (_, y), g = jax.device_get(_grads(sparse_moe, placed, x, ct, mesh))
    return params, y_ref, g_merged, y, g


def test_factor_specs_follow_their_kernel(mesh_factory):
    mesh = mesh_factory(2, 2)
    params, _, _ = _inputs()
    specs = param_specs(CONFIG, DEFAULT_RULES, mesh, {n: w.shape for n, w in params.items()})
    # wi_0 (exp, embed, mlp): A keeps the expert and embed sharding, B the expert one.
    assert specs["wi_0_lora_a"] == P("expert", "fsdp", None)
    assert specs["wi_0_lora_b"] == P("expert", None, None)
    assert specs["wo_lora_b"] == P("expert", None, "fsdp")


def test_sharded_layer_with_factors_equals_the_merged_kernels(results):
    _, y_ref, _, y, _ = results
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_factor_gradients_are_the_merged_gradient_pulled_back(results):
    params, _, g_merged, _, g = results
    for name in ADAPTED:
        a, b, gw = params[f"{name}_lora_a"], params[f"{name}_lora_b"], g_merged[name]
        want_a = SCALE * jnp.matmul(gw, jnp.swapaxes(b, -1, -2))
        want_b = SCALE * jnp.matmul(jnp.swapaxes(a, -1, -2), gw)
        np.testing.assert_allclose(g[f"{name}_lora_a"], want_a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g[f"{name}_lora_b"], want_b, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g[name], gw, rtol=1e-4, atol=1e-5)


def test_half_a_pair_is_refused():
    params, x, _ = _inputs()
    del params["wo_lora_b"]
    with pytest.raises(ValueError, match="LoRA factors of 'wo' need 'wo_lora_a', 'wo_lora_b'"):
        sparse_moe(x, params, config=CONFIG)
    params["wo_lora_b"] = jnp.zeros((8, R + 1, D))
    with pytest.raises(ValueError, match="param 'wo_lora_b' has shape"):
        sparse_moe(x, params, config=CONFIG)


def test_without_factors_the_scale_changes_nothing():
    params, x, _ = _inputs()
    plain = {n: w for n, w in params.items() if "_lora_" not in n}
    other = dataclasses.replace(CONFIG, lora_scale=7.0)
    y1, _ = sparse_moe(x, plain, config=CONFIG)
    y2, _ = sparse_moe(x, plain, config=other)
    np.testing.assert_array_equal(y1, y2)
