"""`sparse_moe(manual=ManualExperts(...))` inside a caller's fully manual shard_map (a
pipeline stage's per-device layer) == the unsharded dense reference, forward and
gradients: the all-to-all dispatch (tokens split over the expert axis) and the
local-experts + psum one (tokens the same on every expert shard)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moe_kernels import ManualExperts, MoEConfig, dense_moe, init_params, sparse_moe

D, EP = 16, 4
CONFIG = MoEConfig(
    num_experts=8, num_experts_per_tok=2, mlp_dim=8, n_groups=4, topk_groups=2,
    routed_scaling_factor=2.5, num_shared_experts=1,
)  # fmt: skip
EXPERT_DIM0 = ("wi_0", "wi_1", "wo")


def _inputs():
    params = init_params(jax.random.key(0), CONFIG, D)
    params["bias"] = 0.05 * jax.random.normal(jax.random.key(3), (CONFIG.num_experts,))
    x = jax.random.normal(jax.random.key(1), (8, 4, D))
    ct = jax.random.normal(jax.random.key(2), (8, 4, D))
    return params, x, ct


def _grads(fn):
    def loss(params, x, ct):
        return jnp.sum(fn(x, params) * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("tokens_split", [True, False], ids=["all_to_all", "local_psum"])
def test_manual_expert_axis_matches_the_reference(mesh_factory, tokens_split):
    mesh = mesh_factory(EP, explicit=False)  # (data=2, fsdp=1, expert=4), Auto axes
    params, x, ct = _inputs()
    want_loss, (want_gp, want_gx) = _grads(
        lambda x, p: dense_moe(x, p, config=CONFIG)[0]
    )(params, x, ct)  # fmt: skip
    rows = P(("data", "expert")) if tokens_split else P("data")
    specs = {n: P("expert") if n in EXPERT_DIM0 else P() for n in params}
    manual = ManualExperts(EP, tokens_split=tokens_split)

    def per_device(x, params, ct):
        # The caller's own region: every axis manual, this device's experts and rows.
        y, _ = sparse_moe(x, params, config=CONFIG, manual=manual, device=mesh.devices.flat[0])
        part = jnp.sum(y * ct)
        # Each token is counted once: on its (data, expert) shard, or over data only.
        return jax.lax.psum(part, ("data", "expert") if tokens_split else "data")

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(rows, specs, rows), out_specs=P())
    loss, (gx, gp) = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))(x, params, ct)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _close(gx, want_gx, "grad x")
    for name in ("gate", "wi_0", "wi_1", "wo", "shared_wo"):
        _close(gp[name], want_gp[name], f"grad {name}")


def _close(actual, expected, name, rtol=1e-5):
    """rtol, with an absolute floor of rtol x max|expected| for entries near 0 (as
    test_moe_equivalence's)."""
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


def test_manual_experts_refuse_a_mesh_and_a_wrong_expert_dim():
    params, x, _ = _inputs()
    with pytest.raises(ValueError, match="pass mesh=None"):
        sparse_moe(x, params, config=CONFIG, manual=ManualExperts(2), mesh=object())
    # Whole kernels where this device should hold 8/2 experts.
    with pytest.raises(ValueError, match=r"param 'wi_0' has shape \(8, 16, 8\), expected \(4,"):
        sparse_moe(x, params, config=CONFIG, manual=ManualExperts(2))
