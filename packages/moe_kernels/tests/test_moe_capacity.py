"""capacity_factor off the all-to-all path, drops per shard, router z, expert-count hints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_kernels import MoEConfig, capacity_plan, dense_moe, init_params, sparse_moe
from moe_kernels.config import fitting_expert_counts
from moe_kernels.dispatch import within_capacity

D = 16


def _setup(experts=8, k=2, batch=8, seq=4, cf=0.0, z=False):
    cfg = MoEConfig(
        num_experts=experts, num_experts_per_tok=k, mlp_dim=8, capacity_factor=cf,
        router_z_loss=z, num_shared_experts=0,
    )  # fmt: skip
    params = init_params(jax.random.key(0), cfg, D)
    x = jax.random.normal(jax.random.key(1), (batch, seq, D))
    return cfg, params, x


def test_within_capacity_keeps_the_first_assignments_of_each_expert():
    ids = jnp.array([3, 1, 3, 3, 1, 0, 3])
    keep = within_capacity(ids, 4, 2)
    # expert 3: positions 0, 2 kept, 3 and 6 dropped; expert 1 and 0 under the cap.
    assert keep.tolist() == [True, True, True, False, True, True, False]


def test_capacity_applies_without_expert_parallelism():
    cfg, params, x = _setup()
    # Every token prefers experts 7 and 6: with cf=1 each expert takes
    # ceil(64/8 * 1) = 8 of the 64 assignments, so 2 x (32 - 8) = 48 are dropped.
    params["bias"] = jnp.zeros(8).at[7].set(10.0).at[6].set(5.0)
    tight = dataclasses.replace(cfg, capacity_factor=1.0)
    y_full, s_full = jax.jit(lambda x: sparse_moe(x, params, config=cfg))(x)
    y_cap, s_cap = jax.jit(lambda x: sparse_moe(x, params, config=tight))(x)
    y_dense, s_dense = jax.jit(lambda x: dense_moe(x, params, config=tight))(x)
    assert int(s_full["dropped"]) == 0
    assert int(s_cap["dropped"]) == 48 == int(s_dense["dropped"])
    # Tokens 0-7 keep both experts; every later token lost both: its routed output is 0.
    y_cap_T = np.asarray(y_cap).reshape(32, D)
    np.testing.assert_allclose(y_cap_T[:8], np.asarray(y_full).reshape(32, D)[:8], rtol=1e-5)
    assert np.all(y_cap_T[8:] == 0)
    np.testing.assert_allclose(np.asarray(y_dense), np.asarray(y_cap), rtol=1e-5, atol=1e-6)
    # A generous cap drops nothing and changes nothing.
    loose = dataclasses.replace(cfg, capacity_factor=8.0)
    y_loose, s_loose = jax.jit(lambda x: sparse_moe(x, params, config=loose))(x)
    assert int(s_loose["dropped"]) == 0
    np.testing.assert_allclose(np.asarray(y_loose), np.asarray(y_full), rtol=1e-6)


def test_capacity_on_the_local_expert_parallel_path(mesh_factory):
    """Batch 6 does not divide data*expert: tokens replicated over the expert axis,
    each expert shard runs its own experts; the cap and count match the dense path."""
    mesh = mesh_factory(4)
    cfg, params, x = _setup(batch=6, seq=3, cf=1.0)
    params["bias"] = jnp.zeros(8).at[7].set(10.0).at[2].set(5.0)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        y_s, s_s = jax.jit(lambda x: sparse_moe(x, params, config=cfg, mesh=mesh))(xs)
        y_d, s_d = jax.jit(lambda x: dense_moe(x, params, config=cfg, mesh=mesh))(xs)
    # 2 data shards of 9 tokens, 18 assignments: cap ceil(18/8) = 3 per expert;
    # experts 7 and 2 get 9 each per shard: 2 x 2 x (9 - 3) = 24 dropped.
    assert int(s_s["dropped"]) == 24 == int(s_d["dropped"])
    assert np.asarray(s_s["dropped_by_shard"]).tolist() == [12, 12]
    np.testing.assert_allclose(np.asarray(y_s), np.asarray(y_d), rtol=1e-5, atol=1e-6)
    plan = capacity_plan(cfg, x.shape, mesh)
    assert (plan.path, plan.assignments, plan.rows, plan.ep) == ("local", 18, 3, 4)
    assert "caps each of the 8 experts at 3 of a token shard's 18" in plan.describe()


def test_dropped_by_shard_on_the_all_to_all_path(mesh_factory):
    mesh = mesh_factory(4)
    cfg, params, x = _setup(cf=1.0)
    params["bias"] = jnp.zeros(8).at[7].set(10.0).at[6].set(5.0)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
        _, stats = jax.jit(lambda x: sparse_moe(x, params, config=cfg, mesh=mesh))(xs)
    by_shard = np.asarray(stats["dropped_by_shard"])
    # 8 token shards of 4 tokens, 8 assignments each, all to the last expert
    # shard whose block holds ceil(8/4 * 1) = 2: 6 dropped per shard.
    assert by_shard.tolist() == [6] * 8 and int(stats["dropped"]) == 48
    plan = capacity_plan(cfg, x.shape, mesh)
    assert (plan.path, plan.assignments, plan.rows) == ("all_to_all", 8, 2)
    no_cap = capacity_plan(dataclasses.replace(cfg, capacity_factor=0.0), x.shape, mesh)
    assert no_cap.rows == 8 and "padded to all 8 assignments" in no_cap.describe()


def test_router_z_per_token(mesh_factory):
    cfg, params, x = _setup(z=True)
    logits = jnp.einsum("bsd,de->bse", x, params["gate"], precision="highest")
    want = jax.nn.logsumexp(logits, axis=-1) ** 2
    _, stats = jax.jit(lambda x: sparse_moe(x, params, config=cfg))(x)
    np.testing.assert_allclose(np.asarray(stats["router_z_BxS"]), np.asarray(want), rtol=1e-5)
    _, off = jax.jit(
        lambda x: sparse_moe(x, params, config=dataclasses.replace(cfg, router_z_loss=False))
    )(x)
    assert "router_z_BxS" not in off
    mesh = mesh_factory(2, 2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))

        def z_mean(gate):
            _, s = sparse_moe(xs, {**params, "gate": gate}, config=cfg, mesh=mesh)
            return jnp.mean(s["router_z_BxS"])

        z, grad = jax.jit(jax.value_and_grad(z_mean))(params["gate"])
    assert float(z) == pytest.approx(float(want.mean()), rel=1e-5)
    ref = jax.grad(lambda g: jnp.mean(jax.nn.logsumexp(x @ g, axis=-1) ** 2))(params["gate"])
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref), rtol=1e-4, atol=1e-6)


def test_fitting_expert_counts_in_the_error(mesh_factory):
    assert fitting_expert_counts(6, 8) == [8, 16]
    assert fitting_expert_counts(12, 8) == [8, 16]
    assert fitting_expert_counts(7, 2) == [6, 8]
    cfg, params, x = _setup(experts=6)
    mesh = mesh_factory(4)
    with pytest.raises(ValueError, match=r"num_experts=6 .* size 4 .*nearest that fit: 4, 8"):
        sparse_moe(x, params, config=cfg, mesh=mesh)
