"""gemm_mgpu's custom_vjp, checked on a CPU host.

JAX's Mosaic-GPU kernels run on an sm_90 GPU only, so here they are replaced by
reference functions with the same signatures and documented semantics
(`ragged_dot(lhs (M,K), rhs (G,K,N) or (G,N,K) with transpose_rhs, group_sizes)` and
`transposed_ragged_dot(lhs (K,M), rhs (K,N), group_sizes) -> (G,M,N)`, K the ragged
dimension). What is checked is ours: which operands the forward and both gradients
hand the kernels, the transposes, the trailing rows folded into the last group, and
that `gmm`'s gradients equal autodiff of `lax.ragged_dot`.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moe_kernels import gemm_mgpu, grouped


def _ref_ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs=False, **tile):
    del tile
    if transpose_rhs:  # rhs is (G, N, K): each group's matrix used transposed
        rhs = jnp.swapaxes(rhs, 1, 2)
    return lax.ragged_dot(lhs, rhs, group_sizes)


def _ref_transposed_ragged_dot(lhs_KxM, rhs_KxN, *, group_sizes, **tile):
    del tile
    ends = jnp.cumsum(group_sizes)
    group_K = jnp.sum(jnp.arange(lhs_KxM.shape[0])[:, None] >= ends[None, :], axis=1)
    onehot_KxG = jax.nn.one_hot(group_K, group_sizes.shape[0], dtype=lhs_KxM.dtype)
    return jnp.einsum("kg,km,kn->gmn", onehot_KxG, lhs_KxM, rhs_KxN)


@pytest.fixture
def reference_kernels(monkeypatch):
    """gemm_mgpu with the two Mosaic kernels replaced by their reference semantics."""
    ragged = types.SimpleNamespace(ragged_dot=_ref_ragged_dot)
    transposed = types.SimpleNamespace(transposed_ragged_dot=_ref_transposed_ragged_dot)
    monkeypatch.setattr(gemm_mgpu, "_kernels", lambda: (ragged, transposed))
    # The SM-count shim swaps a module's `jax`; the reference needs none.
    monkeypatch.setattr(gemm_mgpu, "_sm_count", lambda sms: _null())
    # The kernels' jit wrappers keep what they traced: none of the real kernels'
    # traces is reused here, and none of these outlives the test.
    _clear_kernel_traces()
    yield
    _clear_kernel_traces()


def _clear_kernel_traces():
    gemm_mgpu._ragged_dot.clear_cache()
    gemm_mgpu._transposed_ragged_dot.clear_cache()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _operands(seed=0, p=24, k=8, n=16, e=4):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (p, k), jnp.float32)
    w = jax.random.normal(kw, (e, k, n), jnp.float32)
    sizes = jnp.array([5, 0, 11, 8], jnp.int32)  # an empty group; sums to p
    return x, w, sizes


def test_gmm_forward_and_gradients_equal_ragged_dot(reference_kernels):
    x, w, sizes = _operands()
    cot = jax.random.normal(jax.random.key(7), (x.shape[0], w.shape[2]))

    def ours(x, w):
        return jnp.sum(gemm_mgpu.gmm(x, w, sizes, 132) * cot)

    def ref(x, w):
        return jnp.sum(lax.ragged_dot(x, w, sizes) * cot)

    np.testing.assert_allclose(
        gemm_mgpu.gmm(x, w, sizes, 132), lax.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5
    )
    got_dx, got_dw = jax.grad(ours, argnums=(0, 1))(x, w)
    want_dx, want_dw = jax.grad(ref, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got_dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_dw, want_dw, rtol=1e-5, atol=1e-5)
    # The empty group's weight gets no gradient.
    assert float(jnp.abs(got_dw[1]).max()) == 0.0


def test_swiglu_with_trailing_zero_rows_equals_the_ragged_dot_impl(reference_kernels):
    """Rows past sum(sizes) are zero and fold into the last group: same outputs and
    weight gradients as the ragged_dot implementation, which leaves them out."""
    d, f, e = 8, 16, 4
    sizes = jnp.array([3, 6, 0, 5], jnp.int32)  # 14 of 20 rows used
    p = 20
    keys = jax.random.split(jax.random.key(3), 4)
    rows = jax.random.normal(keys[0], (p, d)) * (jnp.arange(p) < 14)[:, None]
    kernels = (
        jax.random.normal(keys[1], (e, d, f)),
        jax.random.normal(keys[2], (e, d, f)),
        jax.random.normal(keys[3], (e, f, d)),
    )
    group = jnp.repeat(jnp.arange(e), sizes, total_repeat_length=p)

    def loss(impl, rows, kernels):
        out = grouped.swiglu_slots(rows, kernels, sizes, group, impl=impl, align=1)
        return jnp.sum(jnp.sin(out))

    want = jax.grad(lambda r, k: loss("ragged_dot", r, k), argnums=(0, 1))(rows, kernels)
    got = jax.grad(lambda r, k: loss("grouped_gemm", r, k), argnums=(0, 1))(rows, kernels)
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w_, rtol=1e-4, atol=1e-4)


def test_layers_of_one_shape_trace_each_kernel_once(reference_kernels, monkeypatch):
    """Two layers with weights of one shape: each kernel (forward, dx, dw) is traced
    once for both, so the step's module lowers one copy of it (a Mosaic GPU module
    per kernel, not per layer)."""
    traced = []

    def counted(name, fn):
        def kernel(*args, **kwargs):
            traced.append(name + ("_t" if kwargs.get("transpose_rhs") else ""))
            return fn(*args, **kwargs)

        return kernel

    ragged = types.SimpleNamespace(ragged_dot=counted("ragged", _ref_ragged_dot))
    transposed = types.SimpleNamespace(
        transposed_ragged_dot=counted("transposed", _ref_transposed_ragged_dot)
    )
    monkeypatch.setattr(gemm_mgpu, "_kernels", lambda: (ragged, transposed))
    _clear_kernel_traces()
    x, w, sizes = _operands()
    w2 = w * 0.5

    def two_layers(x, w, w2):
        y = gemm_mgpu.gmm(x, w, sizes, 132) + gemm_mgpu.gmm(2.0 * x, w2, sizes, 132)
        return jnp.sum(jnp.sin(y))

    jax.jit(jax.grad(two_layers, argnums=(0, 1, 2))).lower(x, w, w2)
    # Called directly, the kernels were traced once per layer: six entries.
    assert sorted(traced) == ["ragged", "ragged_t", "transposed"], traced
