"""SwiGLU's gate, `silu(gate) * up`, whose backward recomputes it from its inputs.

Differentiated as written, the product is linearized in the forward pass: XLA's
forward fusion writes the sigmoid, silu(gate) and the sigmoid's derivative beside
the product, four (rows, hidden) arrays, and the backward fusion reads them back
with the cotangent. A layer checkpoint that saves everything but casts
(moe_kernels.layer) keeps them all. Saving only `gate` and `up` (the two matmuls'
outputs) and recomputing the rest inside the backward fusion, the forward writes
one array and the backward reads three where it read six (issue 53; the step
times: benchmarks/results/gpu_estimate.md, device_check_tpu_v5e.md). The numbers
are autodiff's own: the backward is `jax.vjp` of the same expression, run on the
saved inputs. Reverse mode only, as every custom_vjp (`jax.jvp` raises).
"""

from __future__ import annotations

import jax


def _gated(gate, up):
    return jax.nn.silu(gate) * up


@jax.custom_vjp
def gated_silu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`jax.nn.silu(gate) * up`, saving only `gate` and `up` for its backward."""
    return _gated(gate, up)


def _gated_silu_fwd(gate, up):
    return _gated(gate, up), (gate, up)


def _gated_silu_bwd(saved, g):
    # Autodiff of the same expression on the saved inputs: the same cotangents
    # (with the same varying/sharding types as the primals, inside a shard_map too)
    # as differentiating `_gated` directly; only what is kept in between changes.
    _, vjp = jax.vjp(_gated, *saved)
    return vjp(g)


gated_silu.defvjp(_gated_silu_fwd, _gated_silu_bwd)
