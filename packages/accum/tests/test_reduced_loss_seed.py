"""A reduced-typed loss (an L2 penalty on a tagged parameter) next to tanh,
sigmoid or gelu: accumulated gradients equal the full-batch ones.

In plain JAX, `jax.grad` of such a loss comes out multiplied by the data axis
size (the compiled step all-reduces the seed's bare 1.0; accum.seed); accum
differentiates an untagged copy of the loss. The squared loss is the case a
seed behind an optimization barrier did not fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum

ROWS, DIM = 16, 4
ACT = P("data", None)  # TAG: batch-sharded activations, as in a data-parallel model


def _loss_fn(activation, out_sharding=ACT):
    def loss_fn(w, mb):
        y = activation(jnp.einsum("bd,de->be", mb["x"], w, out_sharding=out_sharding))
        # The parameter-only term: typed reduced, as `w` is inside accum.
        return jnp.sum(y) + 0.5 * jnp.sum(w * w), {"weight": jnp.float32(1.0)}

    return loss_fn


@pytest.fixture(scope="module")
def setup():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((DIM, DIM)).astype(np.float32), NamedSharding(mesh, P()))
    x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    batch = {"x": jax.device_put(x, NamedSharding(mesh, P("data", None)))}
    return mesh, w, batch


def _square(y):
    return y * y


@pytest.mark.parametrize(
    "activation",
    [jnp.tanh, jax.nn.sigmoid, jax.nn.gelu, _square],
    ids=["tanh", "sigmoid", "gelu", "square"],
)
@pytest.mark.parametrize("schedule", ["plain", "fused"])
def test_reduced_loss_next_to_tanh_gives_full_batch_gradients(setup, activation, schedule):
    mesh, w, batch = setup
    loss_fn = _loss_fn(activation)
    with jax.set_mesh(mesh):
        _, _, grads = jax.jit(
            lambda w, b: accum.accumulate_gradients(
                loss_fn, w, b, num_microbatches=1, schedule=schedule
            )
        )(w, batch)
    # The reference on host: no mesh, no tags. One microbatch of weight 1: the
    # penalty is counted once, as in accum's sum over microbatches.
    host_w, host_x = np.asarray(w), np.asarray(batch["x"])
    host_loss = _loss_fn(activation, out_sharding=None)
    reference = jax.grad(lambda w: host_loss(w, {"x": host_x})[0])(host_w)
    np.testing.assert_allclose(grads, reference, rtol=1e-5, atol=2e-5)
