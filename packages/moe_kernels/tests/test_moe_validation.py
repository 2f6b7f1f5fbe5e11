"""Bad input raises ValueError naming the offending values."""

import jax
import jax.numpy as jnp
import pytest

from moe_kernels import DEFAULT_RULES, MoEConfig, init_params, param_specs, sparse_moe


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(num_experts=8, num_experts_per_tok=9), r"top_k\)=9 .*num_experts=8"),
        (dict(num_experts=8, num_experts_per_tok=0), r"top_k\)=0"),
        (dict(num_experts=8, n_groups=3), r"n_groups=3 .*num_experts=8"),
        (dict(num_experts=8, n_groups=4, topk_groups=5), r"topk_groups=5 .*n_groups=4"),
        (
            dict(num_experts=8, num_experts_per_tok=4, n_groups=4, topk_groups=1),
            r"num_experts_per_tok=4 .*topk_groups=1",
        ),
        (dict(score_func="relu"), r"score_func='relu'"),
        (dict(capacity_factor=-1.0), r"capacity_factor=-1.0"),
        (dict(param_axes={"gate": ("embed", None)}), r"param_axes lacks"),
    ],
)
def test_config_rejects(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoEConfig(**kwargs)


def test_experts_not_divisible_by_expert_axis(mesh_factory):
    mesh = mesh_factory(4)
    cfg = MoEConfig(num_experts=6, num_experts_per_tok=2, mlp_dim=8)
    params = init_params(jax.random.key(0), cfg, 16)
    x = jnp.zeros((8, 2, 16))
    pattern = r"num_experts=6 .*size 4 .*'expert'"
    with pytest.raises(ValueError, match=pattern):
        param_specs(cfg, DEFAULT_RULES, mesh, {n: w.shape for n, w in params.items()})
    with pytest.raises(ValueError, match=pattern):
        sparse_moe(x, params, config=cfg, mesh=mesh)


def test_param_and_input_shapes_checked():
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, mlp_dim=8)
    params = init_params(jax.random.key(0), cfg, 16)
    with pytest.raises(ValueError, match=r"'wo' has shape \(4, 16, 8\), expected \(4, 8, 16\)"):
        sparse_moe(jnp.zeros((2, 2, 16)), {**params, "wo": jnp.zeros((4, 16, 8))}, config=cfg)
    with pytest.raises(ValueError, match=r"lack 'wi_1'"):
        sparse_moe(
            jnp.zeros((2, 2, 16)), {k: v for k, v in params.items() if k != "wi_1"}, config=cfg
        )
    with pytest.raises(ValueError, match=r"\(batch, seq, embed\); got shape \(4, 16\)"):
        sparse_moe(jnp.zeros((4, 16)), params, config=cfg)
    with pytest.raises(ValueError, match=r"mode='manual'"):
        sparse_moe(
            jnp.zeros((2, 2, 16)),
            params,
            config=cfg,
            mesh=jax.make_mesh((8,), ("data",)),
            mode="manual",
        )


def test_expert_dim_only_on_expert_axis(mesh_factory):
    mesh = mesh_factory(2, 2)
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, mlp_dim=8)
    rules = (("exp", "fsdp"),) + tuple(r for r in DEFAULT_RULES if r[0] != "exp")
    params = init_params(jax.random.key(0), cfg, 16)
    with pytest.raises(ValueError, match=r"sharded over \('fsdp',\); only the expert axis"):
        sparse_moe(jnp.zeros((8, 2, 16)), params, config=cfg, mesh=mesh, rules=rules)


def test_numpy_activations_closed_over_by_jit():
    # A host array closed over by jit: the sparse path indexes it with traced
    # routing indices, which a numpy array refuses (TracerArrayConversionError).
    import numpy as np

    from moe_kernels import dense_moe

    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, mlp_dim=8)
    params = init_params(jax.random.key(0), cfg, 16)
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 3, 16)), dtype=np.float32)
    sparse_y, _ = jax.jit(lambda p: sparse_moe(x, p, config=cfg))(params)
    dense_y, _ = jax.jit(lambda p: dense_moe(x, p, config=cfg))(params)
    np.testing.assert_allclose(np.asarray(sparse_y), np.asarray(dense_y), rtol=1e-5, atol=1e-6)
