"""Memory of a scanned MoE stack's gradient: no stacked copy of the expert weights.

Inside the shard_map each weight meets the (varying) tokens through a cast to
varying; autodiff would keep that cast's output for the backward pass, and a
layer scan stacks it: one extra copy of every layer's weights. The layer
recomputes the casts instead. Measured against the same per-device work written
by hand (mesh=None inside one outer shard_map, the parameters made varying
first), which has no such copy.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_kernels import MoEConfig, init_params, sparse_moe

LAYERS, B, S, D = 4, 16, 8, 64
CFG = MoEConfig(num_experts=16, num_experts_per_tok=2, mlp_dim=64, n_groups=4, topk_groups=2)


def _stacked_params():
    keys = jax.random.split(jax.random.key(0), LAYERS)
    layers = [init_params(k, CFG, D) for k in keys]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def _sharded_grads(params, x, mesh, recompute_casts=True):
    def loss(params, x):
        def layer(h, p):
            y, _ = sparse_moe(h, p, config=CFG, mesh=mesh, recompute_casts=recompute_casts)
            return h + y, None

        h, _ = lax.scan(layer, x, params)
        return jnp.sum(h * h)

    # TAG: gradient accumulation's cast: gradients come back unreduced over 'data'.
    reduced = jax.tree.map(lambda w: jax.reshard(w, P(reduced={"data"})), params)
    return jax.grad(loss)(reduced, x)


def _manual_grads(mesh):
    def per_device(params, x):
        params = jax.tree.map(lambda w: lax.pcast(w, "data", to="varying"), params)

        def loss(params, x):
            def layer(h, p):
                y, _ = sparse_moe(h, p, config=CFG)  # mesh=None: per device
                return h + y, None

            h, _ = lax.scan(layer, x, params)
            return jnp.sum(h * h)

        return lax.psum(jax.grad(loss)(params, x), "data")

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())


def test_scanned_moe_grad_needs_no_more_temp_than_the_hand_written_one(mesh_factory):
    if not hasattr(lax, "pcast"):
        pytest.skip("lax.pcast (JAX >= 0.8) is needed to write the reference by hand")
    mesh = mesh_factory(ep=1)
    with jax.set_mesh(mesh):
        params = jax.device_put(_stacked_params(), NamedSharding(mesh, P()))
        x = jax.device_put(jnp.ones((B, S, D)), NamedSharding(mesh, P("data")))

        def temp(fn, *args):
            return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

        sharded = temp(lambda p, x: _sharded_grads(p, x, mesh), params, x)
        manual = temp(_manual_grads(mesh), params, x)
    expert_stack = sum(params[n].nbytes for n in ("wi_0", "wi_1", "wo"))
    # The copy this guards against is a whole expert stack (1.5 MiB here).
    print("TEMP", sharded, manual, expert_stack)
    assert sharded < manual + expert_stack / 4, (sharded, manual, expert_stack)
