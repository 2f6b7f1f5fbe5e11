"""Adam's scaling with a storage dtype for each moment (`mu_dtype`, `nu_dtype`).

optax's `scale_by_adam` takes `mu_dtype` only and computes a bf16 moment's decay in
bf16. Here both moments have a storage dtype, and each step's moment update is
computed in float32 (or the gradient's dtype where wider) from the stored value and
rounded once, to the storage dtype, at the end of the step; this step's update is
computed from the unrounded float32 moments, as optax does. With float32 moments the
arithmetic is optax's, operation for operation (`optax.adamw` gives the same bits,
tests/test_adam_moments.py), and the state is optax's `ScaleByAdamState`, so
checkpoints and code that read `state.mu` see the same tree.

DeepSeek-V3 (report, section 3.3.2) keeps both moments in bf16. A bf16 moment decays
only while its relative step, 1 - beta, exceeds half a bf16 spacing: below 2^-8
`round(beta * m) == m` for some m, whatever precision the product is computed in (the
rounding of the result loses it), so the moment never decays there. The config refuses
that case (trainer.config.validate.MIN_BF16_DECAY).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def _compute_dtype(stored: Any, grad: Any) -> Any:
    """float32, or the wider of the two where one is wider (float64 under x64)."""
    return jnp.promote_types(jnp.promote_types(stored.dtype, grad.dtype), jnp.float32)


def scale_by_adam_moments(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
) -> optax.GradientTransformation:
    """Adam's rescaling (optax.scale_by_adam's, no eps_root or Nesterov) with the first
    moment stored in `mu_dtype` and the second in `nu_dtype` (None: each parameter's
    dtype); updates computed in float32, each moment rounded once per step.

    >>> import jax.numpy as jnp
    >>> tx = scale_by_adam_moments(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> str(state.mu["w"].dtype), str(state.nu["w"].dtype)
    ('bfloat16', 'bfloat16')
    >>> updates, state = tx.update({"w": jnp.full(3, 2.0)}, state)
    >>> [round(u, 4) for u in updates["w"].tolist()]  # bias-corrected: g / (|g| + eps)
    [1.0, 1.0, 1.0]
    """

    def init_fn(params):
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            nu=optax.tree.zeros_like(params, dtype=nu_dtype),
        )

    def moment(grad, stored, decay, order):
        wide = _compute_dtype(stored, grad)
        g = grad.astype(wide)
        # optax's expression and order: (1 - decay) * g**order + decay * m.
        return (1 - decay) * (g**order) + decay * stored.astype(wide)

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        nu = jax.tree.map(lambda g, v: moment(g, v, b2, 2), updates, state.nu)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        # optax's sqrt(v + eps_root) + eps, eps_root = 0. The update stays float32 for a
        # bf16 parameter too: apply_updates rounds parameter + update once.
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)
        # The one rounding of the step: the moments to their storage dtypes.
        mu = jax.tree.map(lambda new, old: new.astype(old.dtype), mu, state.mu)
        nu = jax.tree.map(lambda new, old: new.astype(old.dtype), nu, state.nu)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)
