"""gated_silu: autodiff's gradients, keeping only its two inputs for the backward.

The property it exists for is what the backward pass keeps: `silu(gate) * up`
differentiated as written saves the sigmoid and its derivative terms beside the
product, each a (rows, hidden) array (issue 53: four arrays written per expert
layer and microbatch where one is needed). Checked on the saved residuals of a
SwiGLU MLP, of a whole MoE layer (under its own layer checkpoint) and against
plain autodiff's gradients, in a shard_map whose inputs differ in their
varying axes too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import PartitionSpec as P

from moe_kernels import MoEConfig, gated_silu, init_params, sparse_moe

T, D, F = 32, 16, 24


def _plain(gate, up):
    return jax.nn.silu(gate) * up


def _mlp(act):
    def loss(x, w0, w1, wo):
        return jnp.sum(jnp.dot(act(x @ w0, x @ w1), wo).astype(jnp.float32) ** 2)

    return loss


def _args(dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = ((T, D), (D, F), (D, F), (F, D))
    return tuple(jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True))


def _hidden_residuals(fn, *args, hidden=F):
    """How many saved residuals computed inside `fn` (its arguments aside: the
    weights) have the hidden width as their last dim."""
    saved = saved_residuals(fn, *args)
    return sum(a.ndim >= 2 and a.shape[-1] == hidden and "argument" not in why for a, why in saved)


def test_mlp_saves_gate_up_and_product_only():
    args = _args(jnp.bfloat16)
    # gate, up, and the product (the last matmul's input, for its weight gradient).
    assert _hidden_residuals(_mlp(gated_silu), *args) == 3
    # What it replaces kept the silu's intermediates too (three more).
    assert _hidden_residuals(_mlp(_plain), *args) == 6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_are_autodiffs(dtype):
    args = _args(dtype)
    got = jax.grad(_mlp(gated_silu), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(_mlp(_plain), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float32),
            np.asarray(w, np.float32),
            rtol=2e-2 if dtype == jnp.bfloat16 else 1e-6,
        )


def test_cotangent_of_an_invariant_input_is_summed_in_shard_map(mesh_factory):
    """gate varies over 'data', up does not: up's cotangent is the sum over the
    axis (autodiff's pvary transpose), as the vjp in the backward gives it."""
    mesh = mesh_factory(ep=1)
    gate = jax.random.normal(jax.random.key(1), (8 * 4, F))
    up = jax.random.normal(jax.random.key(2), (4, F))

    def run(act):
        def loss(gate, up):
            def body(g, u):
                return jax.lax.psum(jnp.sum(act(g, u) ** 2), "data")

            gate = jax.reshard(gate, P("data"))
            return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())(
                gate, up
            )

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(gate, up)

    with jax.set_mesh(mesh):
        got, want = run(gated_silu), run(_plain)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_moe_layer_backward_keeps_no_silu_intermediates():
    """A whole MoE layer (its checkpoint saves all but casts): the only (rows,
    hidden) residuals are the routed and shared experts' gate, up and product."""
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, mlp_dim=F, num_shared_experts=1)
    params = init_params(jax.random.key(0), cfg, D)
    x = jax.random.normal(jax.random.key(1), (2, 8, D), jnp.float32)

    def loss(p, x):
        y, _ = sparse_moe(x, p, config=cfg)
        return jnp.sum(y * y)

    # Routed (rows, F) and shared (tokens, F): gate, up, product each; nothing else
    # of the hidden width (the silu's sigmoid and derivative terms were three more
    # per SwiGLU).
    assert _hidden_residuals(loss, params, x) == 6
