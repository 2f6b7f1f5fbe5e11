"""A loss_fn may return its sums unreduced: no collective at all stays in the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools as ht
import pspec_tags as pt

B, D, N = 32, 8, 4


@pytest.fixture(scope="module")
def setup():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        rng = np.random.default_rng(0)
        params = {"w": jax.device_put(rng.normal(size=(D,)).astype(np.float32), P())}
        batch = {
            "x": jax.device_put(rng.normal(size=(B, D)).astype(np.float32), P("data")),
            "mask": jax.device_put((rng.random(B) > 0.2).astype(np.float32), P("data")),
        }
        yield mesh, params, batch


def _loss_fn(total):
    def loss_fn(params, mb):
        y_B = jnp.einsum("bd,d->b", mb["x"], params["w"], out_sharding=P("data"))
        return total(jnp.tanh(y_B) ** 2 * mb["mask"]), {"weight": total(mb["mask"])}

    return loss_fn


UNREDUCED, PLAIN = _loss_fn(pt.unreduced_sum), _loss_fn(jnp.sum)


def _scan(loss_fn):
    return jax.jit(lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=N))


def _dispatch(loss_fn):
    split = lambda b: accum.split_microbatches(b, N)  # noqa: E731

    @jax.jit
    def run(params, batch):
        microbatches = split(batch)
        first = jax.tree.map(lambda x: x[0], microbatches)
        acc = accum.start(loss_fn, params, first)
        for i in range(N):
            acc = accum.add(acc, loss_fn, params, jax.tree.map(lambda x, i=i: x[i], microbatches))
        return accum.finish(acc)

    return run


@pytest.mark.parametrize("build", [_scan, _dispatch], ids=["scan", "dispatch"])
def test_unreduced_sums_give_the_plain_results(setup, build):
    mesh, params, batch = setup
    with jax.set_mesh(mesh):
        got = build(UNREDUCED)(params, batch)
        want = build(PLAIN)(params, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert pt.spec_of(g) is None or not pt.unreduced_axes(pt.spec_of(g))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_unreduced_loss_leaves_no_collective_in_the_loop(setup):
    mesh, params, batch = setup
    with jax.set_mesh(mesh):
        text = _scan(UNREDUCED).lower(params, batch).compile().as_text()
        plain = _scan(PLAIN).lower(params, batch).compile().as_text()
    # Threshold 0: not even a scalar all-reduce may run in the loop.
    ht.assert_reduced_once_per_step(text, max_in_loop_elements=0)
    # The plain sums all-reduce their scalars once per microbatch.
    with pytest.raises(AssertionError, match="inside a loop"):
        ht.assert_reduced_once_per_step(plain, max_in_loop_elements=0)
