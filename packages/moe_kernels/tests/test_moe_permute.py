"""Rows to experts and back by gathers (moe_kernels.permute), the padded blocks' weight
gather, and no scatter left in a compiled MoE step's forward or backward pass."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_kernels import MoEConfig, init_params, permute, routing, sparse_moe
from moe_kernels import grouped as grouped_mod

T, K, E, D = 12, 2, 4, 8


def _keys(seed=0, none=True):
    key_A = np.random.default_rng(seed).integers(0, E + (1 if none else 0), T * K)
    return jnp.asarray(key_A, jnp.int32)


@pytest.mark.parametrize("align", [1, 4])
def test_layout_dest_and_src_are_inverse_and_ordered(align):
    key_A = _keys()
    dest_A, src_P, sizes_E, group_P = jax.jit(permute.layout, static_argnums=(1, 2))(
        key_A, E, align
    )
    key_A, dest_A, src_P = map(np.asarray, (key_A, dest_A, src_P))
    p = permute.num_slots(T * K, E, align)
    assert src_P.shape == (p,) and np.asarray(group_P).shape == (p,)
    np.testing.assert_array_equal(np.asarray(sizes_E), np.bincount(key_A, minlength=E + 1)[:E])
    start = 0
    for e in range(E):
        mine = np.flatnonzero(key_A == e)  # in assignment order
        # Expert e's run: its assignments in order, then zero rows to a multiple of align.
        np.testing.assert_array_equal(dest_A[mine], start + np.arange(len(mine)))
        np.testing.assert_array_equal(src_P[start : start + len(mine)], mine)
        run = -(-len(mine) // align) * align
        assert (src_P[start + len(mine) : start + run] == T * K).all()
        assert (np.asarray(group_P)[start : start + run] == e).all()
        start += run
    assert (dest_A[key_A == E] == p).all()  # no expert: no slot
    assert (src_P[start:] == T * K).all()


def _reference(x_TxD, w_TxK, key_A, out_fn):
    """The same rows and combine by plain indexing (autodiff: scatters)."""
    rows_AxD = jnp.repeat(x_TxD, K, axis=0)
    out_AxD = jnp.where((key_A < E)[:, None], out_fn(rows_AxD), 0.0)
    return jnp.einsum("tkd,tk->td", out_AxD.reshape(T, K, D), w_TxK)


def test_dispatch_and_combine_match_indexing_with_gradients():
    key_A = _keys(1)
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x_TxD = jax.random.normal(kx, (T, D))
    w_TxK = jax.random.uniform(kw, (T, K))
    ct_TxD = jax.random.normal(kc, (T, D))

    def through_slots(x, w):
        dest_A, src_P, _, _ = permute.layout(key_A, E, 4)
        dest_TxK = dest_A.reshape(T, K)
        rows = permute.dispatch(x, src_P, dest_TxK)
        return permute.combine(jnp.tanh(rows) * 3.0, w, src_P, dest_TxK)

    def by_indexing(x, w):
        return _reference(x, w, key_A, lambda r: jnp.tanh(r) * 3.0)

    for fn_a, fn_b in [(through_slots, by_indexing)]:
        ya, vjp_a = jax.vjp(fn_a, x_TxD, w_TxK)
        yb, vjp_b = jax.vjp(fn_b, x_TxD, w_TxK)
        np.testing.assert_allclose(ya, yb, rtol=1e-6, atol=1e-6)
        for ga, gb in zip(vjp_a(ct_TxD), vjp_b(ct_TxD), strict=True):
            np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-6)


def test_per_block_weights_gather_and_sum_back():
    w_ExIxJ = jax.random.normal(jax.random.key(1), (E, 3, 5))
    expert_N = jnp.array([0, 0, 2, 3, 3, 3], jnp.int32)
    ct = jax.random.normal(jax.random.key(2), (6, 3, 5))
    y, vjp = jax.vjp(lambda w: grouped_mod._per_block(w, expert_N), w_ExIxJ)
    np.testing.assert_array_equal(y, w_ExIxJ[expert_N])
    (g,) = vjp(ct)
    want = jnp.zeros_like(w_ExIxJ).at[expert_N].add(ct)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


def _scatters_and_sorts(impl: str, mesh=None) -> tuple[int, int]:
    cfg = MoEConfig(
        num_experts=E,
        num_experts_per_tok=K,
        mlp_dim=16,
        n_groups=2,
        topk_groups=1,
        grouped_matmul=impl,
    )
    params = init_params(jax.random.key(0), cfg, D)
    x = jax.random.normal(jax.random.key(1), (2, 8, D))

    def loss(params, x):
        y, stats = sparse_moe(x, params, config=cfg, mesh=mesh)
        return jnp.mean(y * y) + 0.01 * stats["balance_loss"]

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
    return len(re.findall(r"\bscatter\(", text)), len(re.findall(r"\bsort\(", text))


@pytest.mark.parametrize("impl", ["padded_blocks", "ragged_dot"])
def test_no_scatter_or_sort_in_a_compiled_moe_step(impl):
    """Routing (top-k, the chosen weights, counts), the dispatch, the combine and the
    padded blocks' weights: no scatter forward or backward (a gather's autodiff
    transpose would be one) and no sort (lax.top_k, argsort)."""
    assert _scatters_and_sorts(impl) == (0, 0)


def test_grouped_gemm_auto_only_on_hopper():
    impl, why = grouped_mod.choose("auto", "cpu", jnp.bfloat16, (1024, 512))
    assert impl == "ragged_dot"
    impl, why = grouped_mod.choose("auto", "gpu", jnp.bfloat16, (1024, 512))
    assert impl == "padded_blocks" and "compute capability None" in why
    with pytest.raises(ValueError, match="grouped_matmul=grouped_gemm cannot run here"):
        grouped_mod.choose("grouped_gemm", "cpu", jnp.float32, (1024, 500))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_matches_lax_with_ties_and_infs(k):
    rng = np.random.default_rng(k)
    x = rng.integers(0, 4, (7, 6)).astype(np.float32)  # many ties
    x[0] = -np.inf  # all -inf: the first k indices, in order
    x[1, 2:] = -np.inf
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    got_v, got_i = routing.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_v, want_v)
    grads = jax.grad(lambda v: routing.top_k(v, k)[0].sum())(jnp.asarray(rng.normal(size=(7, 6))))
    assert (np.asarray(grads).sum(-1) == k).all()
