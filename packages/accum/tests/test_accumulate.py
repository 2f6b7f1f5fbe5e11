"""accumulate_gradients: equality with full-batch gradients on every mesh, and its edges."""

import jax
import numpy as np
import pytest

import accum
from pspec_tags import spec_of, unreduced_axes

CASES = [("data8", n) for n in (1, 2, 3, 4)] + [
    (name, n) for name in ("data4_fsdp2", "data2_expert4", "data2_tensor2_fsdp2") for n in (1, 3)
]


def _accumulated(setup, n, policy="deferred"):
    def build():
        def fn(params, batch):
            plan = accum.plan_for(params, batch, policy=policy)
            return accum.accumulate_gradients(
                setup.model.loss_fn, params, batch, num_microbatches=n, plan=plan
            )

        return jax.jit(fn).lower(setup.params, setup.batch).compile()

    return setup.cached(("accumulate", n, policy), build)


@pytest.mark.parametrize(("mesh", "n"), CASES)
def test_grads_equal_full_batch(get_setup, close, mesh, n):
    setup = get_setup(mesh)
    (ref_loss, ref_aux), ref_grads = setup.reference()
    loss, aux, grads = _accumulated(setup, n)(setup.params, setup.batch)
    close(loss, ref_loss, rtol=1e-5)
    close(aux, ref_aux, rtol=1e-5)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    # Returned gradients are reduced, laid out like their parameters.
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(setup.params), strict=True):
        assert not unreduced_axes(spec_of(g))
        assert spec_of(g).partitions == spec_of(p).partitions


def test_auto_mode_same_numerics(get_setup, close):
    setup = get_setup("data8", "auto")
    (ref_loss, _), ref_grads = setup.reference()
    loss, aux, grads = _accumulated(setup, 3)(setup.params, setup.batch)
    assert accum.resolve_mode(None, setup.params) == "auto"
    close(loss, ref_loss, rtol=1e-5)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_per_microbatch_reduction_same_grads(get_setup, close):
    setup = get_setup("data8")
    _, ref_grads = setup.reference()
    _, _, grads = _accumulated(setup, 4, policy="per_microbatch")(setup.params, setup.batch)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_zero_weight_gives_zeros_not_nan(get_setup):
    setup = get_setup("data8")
    mask = setup.batch["mask"]
    batch = dict(setup.batch, mask=jax.device_put(np.zeros(mask.shape, mask.dtype), mask.sharding))

    @jax.jit
    def fn(params, batch):
        return accum.accumulate_gradients(setup.model.loss_fn, params, batch, num_microbatches=2)

    with jax.set_mesh(setup.mesh):
        loss, aux, grads = fn(setup.params, batch)
    assert float(aux["weight"]) == 0.0
    assert float(loss) == 0.0
    for g in jax.tree.leaves(grads):
        assert np.all(np.asarray(g) == 0.0)


def test_zero_weight_microbatch_contributes_nothing(get_setup, close):
    setup = get_setup("data8")
    # Microbatch 0 of a strided split by 2 holds the even rows: pad all of them.
    mask = np.asarray(setup.batch["mask"]).copy()
    mask[0::2] = 0.0
    batch = dict(setup.batch, mask=jax.device_put(mask, setup.batch["mask"].sharding))
    odd = jax.tree.map(lambda x: jax.device_put(np.asarray(x)[1::2], x.sharding), setup.batch)

    @jax.jit
    def accumulated(params, batch):
        return accum.accumulate_gradients(setup.model.loss_fn, params, batch, num_microbatches=2)

    @jax.jit
    def only_odd(params, batch):
        return jax.value_and_grad(setup.model.full_batch_loss, has_aux=True)(params, batch)

    with jax.set_mesh(setup.mesh):
        loss, _, grads = accumulated(setup.params, batch)
        (ref_loss, _), ref_grads = only_odd(setup.params, odd)
    close(loss, ref_loss, rtol=1e-5)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_indivisible_batch_names_both_numbers(get_setup):
    setup = get_setup("data8")
    with jax.set_mesh(setup.mesh), pytest.raises(ValueError, match=r"96.*5"):
        jax.jit(
            lambda p, b: accum.accumulate_gradients(setup.model.loss_fn, p, b, num_microbatches=5)
        ).trace(setup.params, setup.batch)
    # 96 / 8 = 12 rows per microbatch cannot be split over 8 devices.
    with jax.set_mesh(setup.mesh), pytest.raises(ValueError, match=r"microbatch size 12"):
        jax.jit(
            lambda p, b: accum.accumulate_gradients(setup.model.loss_fn, p, b, num_microbatches=8)
        ).trace(setup.params, setup.batch)


@pytest.mark.parametrize(
    ("mesh", "deferred"),
    [
        ("data8", ("data",)),
        ("data4_fsdp2", ("data",)),
        ("data2_expert4", ("data",)),
        ("data2_tensor2_fsdp2", ("data",)),
    ],
)
def test_gating(get_setup, mesh, deferred):
    setup = get_setup(mesh)
    batch_axes = accum.batch_axes_of(setup.batch)
    assert set(batch_axes) >= set(deferred)
    assert accum.deferred_axes(setup.params, batch_axes) == deferred
    assert accum.data_is_only_batch_axis(setup.params, batch_axes)
    # An axis that shards a parameter never carries a deferred reduction.
    used = accum.param_mesh_axes(setup.params)
    assert not accum.data_is_only_batch_axis(setup.params, tuple(used))


def test_gating_is_off_in_auto_mode(get_setup):
    setup = get_setup("data8", "auto")
    assert accum.batch_axes_of(setup.batch) == ()
    assert not accum.data_is_only_batch_axis(setup.params, ("data",))


def test_rng_is_folded_per_microbatch(get_setup):
    setup = get_setup("data8")

    def noisy(params, mb, rng):
        loss_sum, aux = setup.model.loss_fn(params, mb)
        return loss_sum + jax.random.uniform(rng, ()) * aux["weight"], aux

    @jax.jit
    def fn(params, batch, rng):
        return accum.accumulate_gradients(noisy, params, batch, num_microbatches=2, rng=rng)[0]

    with jax.set_mesh(setup.mesh):
        plain = fn(setup.params, setup.batch, jax.random.key(0))
        again = fn(setup.params, setup.batch, jax.random.key(0))
        other = fn(setup.params, setup.batch, jax.random.key(1))
    assert float(plain) == float(again)
    assert float(plain) != float(other)


def test_deferred_and_per_microbatch_losses_agree_over_steps(get_setup):
    optax = pytest.importorskip("optax")
    setup = get_setup("data8")
    optimizer = optax.adam(1e-2)

    def run(policy):
        @jax.jit
        def step(params, opt_state, batch):
            return accum.train_step(
                setup.model.loss_fn,
                optimizer,
                params,
                opt_state,
                batch,
                num_microbatches=4,
                plan=accum.plan_for(params, batch, policy=policy),
            )

        params, opt_state, losses = setup.params, optimizer.init(setup.params), []
        for _ in range(4):
            params, opt_state, loss, _ = step(params, opt_state, setup.batch)
            losses.append(float(loss))
        return np.array(losses)

    with jax.set_mesh(setup.mesh):
        tagged, untagged = run("deferred"), run("per_microbatch")
    assert tagged[-1] < tagged[0]  # the steps do train
    np.testing.assert_allclose(tagged, untagged, rtol=1e-5)
