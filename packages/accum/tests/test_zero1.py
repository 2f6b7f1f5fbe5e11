"""ZeRO-1: data-sharded masters and optimizer state, one reduction into the shards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import accum
import hlo_tools as ht
from pspec_tags import mesh_axes_used

optax = pytest.importorskip("optax")
N = 2
STEPS = 2


def _setup_zero1(setup):
    def build():
        optimizer = optax.adam(1e-2)
        shardings = accum.zero1_shardings(setup.params)
        master = jax.device_put(setup.params, shardings)
        abstract = jax.eval_shape(optimizer.init, master)
        state_shardings = accum.zero1_state_shardings(abstract, master, shardings, setup.mesh)
        init = jax.jit(optimizer.init, out_shardings=state_shardings)

        def z_step(master, opt_state, batch):
            return accum.zero1_step(
                setup.model.loss_fn,
                optimizer,
                master,
                opt_state,
                batch,
                num_microbatches=N,
                compute_shardings=setup.specs,
                master_shardings=shardings,
            )

        def p_step(params, opt_state, batch):
            return accum.train_step(
                setup.model.loss_fn, optimizer, params, opt_state, batch, num_microbatches=N
            )

        z_opt = init(master)
        z_step = jax.jit(z_step).lower(master, z_opt, setup.batch).compile()
        p_step = jax.jit(p_step)
        return optimizer, shardings, master, init, z_step, p_step

    return setup.cached(("zero1",), build)


@pytest.fixture(scope="module", params=["explicit", "auto"])
def zero1_run(request, get_setup):
    setup = get_setup("data8", request.param)
    optimizer, shardings, master, init, z_step, p_step = _setup_zero1(setup)
    with jax.set_mesh(setup.mesh):
        z_params, z_state = master, init(master)
        p_params, p_state = setup.params, optimizer.init(setup.params)
        z_losses, p_losses = [], []
        for _ in range(STEPS):
            z_params, z_state, z_loss, _ = z_step(z_params, z_state, setup.batch)
            p_params, p_state, p_loss, _ = p_step(p_params, p_state, setup.batch)
            z_losses.append(float(z_loss))
            p_losses.append(float(p_loss))
    return setup, shardings, z_step, (z_params, z_state, z_losses), (p_params, p_losses)


def test_zero1_equals_plain_steps(zero1_run, close):
    _, _, _, (z_params, _, z_losses), (p_params, p_losses) = zero1_run
    np.testing.assert_allclose(z_losses, p_losses, rtol=1e-5)
    close(z_params, p_params, rtol=1e-5, atol=1e-6)


def test_master_and_optimizer_state_are_data_sharded(zero1_run):
    _, shardings, _, (z_params, z_state, _), _ = zero1_run
    flat = jax.tree.leaves(shardings)
    assert all("data" in mesh_axes_used(s.spec) for s in flat)
    for p, s in zip(jax.tree.leaves(z_params), flat, strict=True):
        assert p.sharding.is_equivalent_to(s, p.ndim)
    adam = z_state[0]  # optax.adam = chain(scale_by_adam, scale): mu and nu shard too
    for m, s in zip(jax.tree.leaves((adam.mu, adam.nu)), flat * 2, strict=True):
        assert m.sharding.is_equivalent_to(s, m.ndim)


def test_zero1_reduces_once_into_the_shards(get_setup):
    # Explicit mode only: auto mode leaves placement to XLA.
    z_step = _setup_zero1(get_setup("data8"))[4]
    outside = ht.assert_reduced_once_per_step(z_step.as_text(), max_in_loop_elements=8)
    assert outside


def test_grads_land_in_the_sharded_layout(get_setup):
    setup = get_setup("data8")
    shardings = accum.zero1_shardings(setup.params)

    @jax.jit
    def grads(params, batch):
        return accum.accumulate_gradients(
            setup.model.loss_fn, params, batch, num_microbatches=N, grad_shardings=shardings
        )[2]

    with jax.set_mesh(setup.mesh):
        traced = grads.trace(setup.params, setup.batch)
    for o, s in zip(jax.tree.leaves(traced.out_info), jax.tree.leaves(shardings), strict=True):
        assert o.sharding.spec == s.spec, (o.sharding.spec, s.spec)


@pytest.mark.parametrize("mesh", ["data4_fsdp2", "data2_tensor2_fsdp2"])
def test_zero1_with_fsdp_is_rejected(get_setup, mesh):
    setup = get_setup(mesh)
    with pytest.raises(ValueError, match=r"ZeRO-1.*FSDP.*'fsdp'"):
        accum.zero1_shardings(setup.params)


def test_zero1_shardings_keep_other_partitions(get_setup):
    setup = get_setup("data2_expert4")
    shardings = accum.zero1_shardings(setup.params)
    we = shardings["layers"]["we"].spec
    assert "expert" in mesh_axes_used(we) and "data" in mesh_axes_used(we)
    assert isinstance(shardings["embed"], NamedSharding)


def test_zero1_bf16_compute_gathers_once_and_reduces_once(get_setup):
    setup = get_setup("data8")
    optimizer = optax.sgd(1e-2)
    shardings = accum.zero1_shardings(setup.params)

    def step(master, opt_state, batch):
        return accum.zero1_step(
            setup.model.loss_fn,
            optimizer,
            master,
            opt_state,
            batch,
            num_microbatches=N,
            compute_shardings=setup.specs,
            compute_dtype=jnp.bfloat16,
        )

    with jax.set_mesh(setup.mesh):
        master = jax.device_put(setup.params, shardings)
        opt_state = optimizer.init(master)
        compiled = jax.jit(step).lower(master, opt_state, setup.batch).compile()
        new_master, _, loss, _ = compiled(master, opt_state, setup.batch)
    ht.assert_reduced_once_per_step(compiled.as_text(), max_in_loop_elements=8)
    # The parameter gather happens before the loop, once per step. (XLA:CPU
    # moves the bf16 convert after the all-gather, so the dtype is not asserted.)
    gathers = [c for c in ht.collectives(compiled.as_text()) if c.kind == "all-gather"]
    assert len(gathers) >= len(jax.tree.leaves(master))
    assert not any(c.in_loop for c in gathers)
    (ref_loss, _), _ = setup.reference()
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-2)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new_master))


def test_zero1_reduction_is_a_reduce_scatter_into_the_shards():
    """8 CPU devices: the one reduction lands in the shards as a reduce-scatter
    (each device receives 1/8 of the sum), not as an all-reduce then a slice."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P()))
        x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("data")))

        def loss_fn(params, mb):
            y = jnp.einsum("bd,de->be", mb, params["w"], out_sharding=P("data"))
            return jnp.sum(y * y), {"weight": jnp.float32(mb.shape[0])}

        def step(params, batch):
            return accum.accumulate_gradients(
                loss_fn, params, batch, num_microbatches=2, grad_shardings={"w": P("data")}
            )

        text = jax.jit(step).lower({"w": w}, x).compile().as_text()
        loss, _, grads = jax.jit(step)({"w": w}, x)
    (scatter,) = [c for c in ht.collectives(text) if c.kind == "reduce-scatter"]
    assert scatter.shape == (8, 32) and not scatter.in_loop
    assert tuple(grads["w"].sharding.spec)[:1] == ("data",)
    want = jax.grad(lambda w: jnp.sum((jnp.ones((32, 64)) @ w) ** 2))(jnp.ones((64, 32))) / 32
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(want), rtol=1e-6)


def test_zero1_compute_dtype_leaves_bool_and_int_parameters_alone():
    """compute_dtype casts floating leaves only: a bool mask or an int counter cast to
    bf16 was taken for a trainable weight, and SGD's update written back flipped the
    mask and changed the counter."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    P = jax.sharding.PartitionSpec
    params = {
        "w": jnp.ones(8),
        "mask": jnp.array([True, False] * 4),
        "count": jnp.full(8, 3, jnp.int32),
    }

    def loss_fn(p, mb):
        scale = p["mask"].astype(jnp.float32) * p["count"].astype(jnp.float32)
        return jnp.sum(mb["x"] @ (p["w"] * scale)), {"weight": jnp.float32(mb["x"].shape[0])}

    optimizer = optax.sgd(1.0)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batch = {"x": jnp.arange(128.0).reshape(16, 8) / 50}
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        master = jax.device_put(params, accum.zero1_shardings(params))
        compute = jax.tree.map(lambda _: P(), params)
        step = jax.jit(
            lambda m, s, b: accum.zero1_step(
                loss_fn,
                optimizer,
                m,
                s,
                b,
                num_microbatches=2,
                compute_shardings=compute,
                compute_dtype=jnp.bfloat16,
            )  # fmt: skip
        )
        new = step(master, optimizer.init(master), batch)[0]
    np.testing.assert_array_equal(new["mask"], params["mask"])
    np.testing.assert_array_equal(new["count"], params["count"])
    assert not np.allclose(new["w"], params["w"])  # the float weight did train
