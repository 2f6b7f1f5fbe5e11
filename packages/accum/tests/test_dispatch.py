"""start / add / finish: accumulation across separate jit calls."""

import jax
import numpy as np
import pytest

import accum
import hlo_tools as ht
from pspec_tags import spec_of, unreduced_axes

N = 3


def _microbatches(setup):
    """The strided split accumulate_gradients uses, as separate host-placed batches."""
    return [
        jax.tree.map(lambda x, i=i: jax.device_put(np.asarray(x)[i::N], x.sharding), setup.batch)
        for i in range(N)
    ]


def _fns(setup, rng):
    def build():
        def noisy(params, mb, key):
            loss_sum, aux = setup.model.loss_fn(params, mb)
            return loss_sum + jax.random.uniform(key, ()) * aux["weight"], aux

        mbs = _microbatches(setup)
        start = jax.jit(lambda p, mb, r: accum.start(noisy, p, mb, rng=r))
        acc0 = start(setup.params, mbs[0], rng)
        add = jax.jit(lambda a, p, mb, r: accum.add(a, noisy, p, mb, rng=r), donate_argnums=0)
        add = add.lower(acc0, setup.params, mbs[0], rng).compile()
        finish = jax.jit(accum.finish).lower(acc0).compile()

        def scan_path(p, b, r):
            return accum.accumulate_gradients(noisy, p, b, num_microbatches=N, rng=r)

        scanned = jax.jit(scan_path)(setup.params, setup.batch, rng)
        return start, add, finish, mbs, scanned

    return setup.cached(("dispatch",), build)


@pytest.fixture(scope="module")
def dispatch(get_setup):
    setup = get_setup("data8")
    rng = jax.random.key(7)
    start, add, finish, mbs, scanned = _fns(setup, rng)
    with jax.set_mesh(setup.mesh):
        acc = start(setup.params, mbs[0], rng)
        for mb in mbs:
            acc = add(acc, setup.params, mb, rng)
        between = acc
        result = finish(acc)
    return setup, add, finish, between, result, scanned


def test_equals_scan_path(dispatch, close):
    _, _, _, _, (loss, aux, grads), (s_loss, s_aux, s_grads) = dispatch
    close(loss, s_loss, rtol=1e-5)
    close(aux, s_aux, rtol=1e-5)
    close(grads, s_grads, rtol=1e-5, atol=1e-6)


def test_equals_full_batch(dispatch, close):
    setup, _, _, _, (_, aux, grads), _ = dispatch
    (_, ref_aux), ref_grads = setup.reference()
    close(aux, ref_aux, rtol=1e-5)
    # The rng term adds weight * u_i to each microbatch's loss: constant in params.
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_accumulator_is_unreduced_between_calls(dispatch):
    _, _, _, between, _, _ = dispatch
    assert int(between.count) == N
    for g in jax.tree.leaves(between.grads):
        assert unreduced_axes(spec_of(g)) == {"data"}


def test_add_holds_no_gradient_reduction_and_finish_does(dispatch):
    setup, add, finish, _, _, _ = dispatch
    add_sizes = ht.cross_replica_all_reduce_sizes(add.as_text().splitlines())
    assert max(add_sizes, default=0) <= 8, add_sizes
    finish_sizes = ht.cross_replica_all_reduce_sizes(finish.as_text().splitlines())
    biggest = max(x.size for x in jax.tree.leaves(setup.params))
    assert max(finish_sizes, default=0) >= biggest, finish_sizes


def test_add_without_deferral_reduces_in_add(get_setup):
    # The negative case: untagged accumulation pays a gradient all-reduce per call.
    setup = get_setup("data8")
    mb = _microbatches(setup)[0]
    with jax.set_mesh(setup.mesh):
        per_microbatch = lambda p, b: accum.plan_for(p, b, policy="per_microbatch")  # noqa: E731
        acc = jax.jit(
            lambda p, b: accum.start(setup.model.loss_fn, p, b, plan=per_microbatch(p, b))
        )(setup.params, mb)
        text = (
            jax.jit(lambda a, p, b: accum.add(a, setup.model.loss_fn, p, b))
            .lower(acc, setup.params, mb)
            .compile()
            .as_text()
        )
    assert max(ht.cross_replica_all_reduce_sizes(text.splitlines())) > 8


def test_a_bf16_weight_is_summed_in_f32_across_adds():
    """aux sums across `add` calls are kept in f32 for a narrower float: in bf16,
    256 + 1 rounds back to 256, and the gradients (divided by it) came out too large."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jnp.arange(32.0).reshape(8, 4) / 10

    def loss_fn(w, mb):
        mask = mb["m"].astype(jnp.bfloat16)  # a bf16 count of the rows counted
        return jnp.sum((mb["x"] @ w) * mb["m"]), {"weight": jnp.sum(mask)}

    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.array([0.5, -1.0, 2.0, 0.25]), NamedSharding(mesh, P()))
        many = {"x": x, "m": jnp.full(8, 32.0)}  # weight 256
        one = {"x": x, "m": jnp.zeros(8).at[0].set(1.0)}  # weight 1
        many, one = jax.device_put((many, one), NamedSharding(mesh, P("data")))
        acc = jax.jit(accum.start, static_argnums=0)(loss_fn, w, many)
        add = jax.jit(accum.add, static_argnums=1)
        acc = add(add(acc, loss_fn, w, many), loss_fn, w, one)
        _, aux, grads = jax.jit(accum.finish)(acc)
    assert float(aux["weight"]) == 257.0

    host_w, host_many, host_one = jax.device_get((w, many, one))

    def total(w):
        return loss_fn(w, host_many)[0] + loss_fn(w, host_one)[0]

    np.testing.assert_allclose(grads, jax.grad(total)(host_w) / 257.0, rtol=1e-5)
