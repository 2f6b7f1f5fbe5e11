"""start / add / finish on the local path (issue #44): a model the tags refuse
(a bias added to batch-sharded rows) and an auto mesh accumulate across
separate dispatches with the full batch's gradients, no gradient-sized
reduction in the compiled `add`, and the same numbers (dropout keys included)
as `accumulate_gradients` on the same path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

N = 2  # microbatches


def _setup(kind):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis,))
    rng = np.random.default_rng(0)
    params = jax.device_put(
        {
            "w": rng.normal(size=(4, 16)).astype(np.float32),
            "b": rng.normal(size=(16,)).astype(np.float32),
        },
        NamedSharding(mesh, P()),
    )
    batch = jax.device_put(
        {"x": rng.normal(size=(32, 4)).astype(np.float32)}, NamedSharding(mesh, P("data"))
    )
    return mesh, params, batch


def loss_fn(p, mb, rng=None):
    h = jnp.tanh(mb["x"] @ p["w"] + p["b"])  # the bias add: no reduced rule (tags refused)
    if rng is not None:  # dropout: the keys must match between the two ways
        h = h * jax.random.bernoulli(rng, 0.5, h.shape) * 2.0
    return jnp.sum(h * h), {"weight": jnp.float32(mb["x"].shape[0])}


def _by_dispatch(params, batch, rng, plan=None):
    microbatches = accum.split_microbatches(batch, N)
    first = jax.tree.map(lambda x: x[0], microbatches)
    start = jax.jit(lambda p, m, r: accum.start(loss_fn, p, m, rng=r, plan=plan))
    acc = start(params, first, rng)
    add = jax.jit(lambda a, p, m, r: accum.add(a, loss_fn, p, m, rng=r))
    compiled = accum.compile_checked(add, acc, params, first, rng)
    for i in range(N):
        acc = compiled(acc, params, jax.tree.map(lambda x, i=i: x[i], microbatches), rng)
    return acc, compiled, jax.jit(accum.finish)(acc)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_start_add_finish_on_the_local_path(kind):
    mesh, params, batch = _setup(kind)
    with jax.set_mesh(mesh):
        acc, compiled_add, (loss, aux, grads) = _by_dispatch(params, batch, None)
        scanned = jax.jit(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=N)
        )
        want_loss, _, want = scanned(params, batch)
    assert acc.plan.path == "local", acc.plan.summary()
    assert acc.grads["w"].shape == (8, 4, 16)  # one row of partial sums per device
    ref = jax.grad(lambda p: loss_fn(p, jax.device_get(batch))[0] / 32)(jax.device_get(params))
    for name in ("w", "b"):
        np.testing.assert_allclose(grads[name], ref[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert float(aux["weight"]) == 32.0
    # The compiled add reduces only scalars (loss, weight); the gradients stay per device.
    module = hlo_tools.parse(compiled_add.as_text())
    big = [
        c.type_str
        for c in hlo_tools.collectives(module)
        if c.kind in hlo_tools.REDUCTION_KINDS and max(a.elements for a in c.arrays) > 8
    ]
    assert not big, big


def test_local_add_folds_dropout_keys_as_the_scan_does():
    mesh, params, batch = _setup("explicit")
    rng = jax.random.key(3)
    with jax.set_mesh(mesh):
        _, _, (loss, _, grads) = _by_dispatch(params, batch, rng)
        want_loss, _, want = jax.jit(
            lambda p, b, r: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=N, rng=r)
        )(params, batch, rng)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-5, atol=1e-7)


def test_local_add_refuses_the_fused_schedule():
    mesh, params, batch = _setup("explicit")
    first = jax.tree.map(lambda x: x[0], accum.split_microbatches(batch, N))
    with jax.set_mesh(mesh):
        acc = jax.jit(accum.start, static_argnums=0)(loss_fn, params, first)
        with pytest.raises(ValueError, match="schedule='fused' needs the tags path"):
            jax.eval_shape(
                lambda a, p, m: accum.add(a, loss_fn, p, m, schedule="fused"), acc, params, first
            )


def test_a_weight_sharded_over_the_batch_axis_on_the_local_path():
    """An FSDP-style weight sharded over 'data' on an explicit mesh: the local path's
    shard_map takes weights whole over the batch axes, and JAX refuses an explicitly
    sharded argument there ("in_specs ... does not match"); accum gathers it once,
    before the loop. Both ways give the full batch's gradients, on the weight's own
    layout."""
    mesh, params, batch = _setup("explicit")
    with jax.set_mesh(mesh):
        params = {**params, "w": jax.device_put(params["w"], NamedSharding(mesh, P(None, "data")))}
        plan = accum.plan_for(params, batch, path="local")
        scanned = jax.jit(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=N, plan=plan)
        )
        loss, _, grads = scanned(params, batch)
        _, _, (_, _, dispatched) = _by_dispatch(params, batch, None, plan)
    ref = jax.grad(lambda p: loss_fn(p, jax.device_get(batch))[0] / 32)(jax.device_get(params))
    for got in (grads, dispatched):
        for name in ("w", "b"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-7)
        assert got["w"].sharding.spec == P(None, "data")
    assert np.isfinite(float(loss))
