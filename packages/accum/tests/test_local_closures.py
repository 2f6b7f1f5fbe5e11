"""A loss_fn closing over a jitted step's traced values on the local path
(issue #44): linen BatchNorm reading its running averages from the closure
(the usual TrainState pattern) and a traced temperature. On an auto mesh JAX
passes them into the shard_map: DDP gradients, no in-loop reduction, through
accumulate_gradients and start/add/finish. On an explicit mesh JAX 0.10.2
refuses them inside a shard_map: a one-line error saying what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

nn = pytest.importorskip("flax.linen")
N, ROWS = 2, 64  # microbatches, batch rows (8 devices: 4 rows per device and microbatch)
FIX = "pass it through the params or the batch"


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        # No bias before the batch norm: the norm subtracts its mean, so that
        # bias's gradient is zero and any comparison of it compares float noise.
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(8, use_bias=False)(x))
        return nn.Dense(1)(nn.relu(x))


def _setup(kind):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis,))
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (ROWS, 4)), "y": jax.random.normal(key_y, (ROWS, 1))}
    variables = Model().init(jax.random.key(0), batch["x"][:1])
    variables = jax.device_put(variables, NamedSharding(mesh, P()))
    return mesh, variables, jax.device_put(batch, NamedSharding(mesh, P("data")))


def make_loss(batch_stats, temperature):
    """The usual pattern: loss_fn closes over the step's running averages."""

    def loss_fn(params, mb):
        variables = {"params": params, "batch_stats": batch_stats}
        out, _ = Model().apply(variables, mb["x"], mutable=["batch_stats"])
        err = (out - mb["y"]) / temperature
        return jnp.sum(err * err), {"weight": jnp.float32(out.shape[0])}

    return loss_fn


def scanned(params, batch_stats, batch, temperature):
    loss_fn = make_loss(batch_stats, temperature)
    return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)[2]


def dispatched(params, batch_stats, batch, temperature):
    """start/add/finish in one jit, the closure over the jitted step's arguments."""
    loss_fn = make_loss(batch_stats, temperature)
    microbatches = accum.split_microbatches(batch, N)
    acc = accum.start(loss_fn, params, jax.tree.map(lambda x: x[0], microbatches))
    for i in range(N):
        acc = accum.add(acc, loss_fn, params, jax.tree.map(lambda x, i=i: x[i], microbatches))
    return accum.finish(acc)[2]


def _ddp_reference(variables, batch, temperature):
    """Each device's rows of each microbatch (accum.local) through BatchNorm."""
    variables, batch = jax.device_get((variables, batch))
    loss_fn = make_loss(variables["batch_stats"], temperature)
    block = ROWS // 8
    groups = [np.arange(d * block + i, (d + 1) * block, N) for d in range(8) for i in range(N)]
    grads = [
        jax.grad(lambda p, g=g: loss_fn(p, jax.tree.map(lambda x: x[g], batch))[0])(
            variables["params"]
        )
        for g in groups
    ]
    return jax.tree.map(lambda *g: sum(g) / ROWS, *grads)


@pytest.mark.parametrize("step", [scanned, dispatched])
def test_closing_over_batch_stats_and_temperature_on_an_auto_mesh(step):
    mesh, variables, batch = _setup("auto")
    args = (variables["params"], variables["batch_stats"], batch, jnp.float32(0.5))
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, *args)
        grads = compiled(*args)
    ref = _ddp_reference(variables, batch, 0.5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    if step is scanned:  # no gradient-sized reduction inside the microbatch loop
        module = hlo_tools.parse(compiled.as_text())
        reductions = [
            c for c in hlo_tools.collectives(module) if c.kind in hlo_tools.REDUCTION_KINDS
        ]
        big = [c.type_str for c in reductions if c.loops and max(a.elements for a in c.arrays) > 8]
        assert not big, big
        assert any(not c.loops for c in reductions)


def temperature_only(params, batch, temperature):
    """Stock Dense (bias: the tags refuse it, local path) and a traced temperature."""

    def loss_fn(p, mb):
        err = (nn.Dense(1).apply({"params": p}, mb["x"]) - mb["y"]) / temperature
        return jnp.sum(err * err), {"weight": jnp.float32(err.shape[0])}

    plan = accum.choose_path(
        loss_fn, params, batch, num_microbatches=N, plan=accum.plan_for(params, batch)
    )
    assert plan.path == "local", plan.summary()
    return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)


def test_closing_over_a_traced_scalar_temperature():
    mesh, _, batch = _setup("auto")
    params = nn.Dense(1).init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    params = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(temperature_only, params, batch, jnp.float32(0.5))
        _, _, grads = compiled(params, batch, jnp.float32(0.5))
    params, batch = jax.device_get((params, batch))

    def full(p):
        err = (nn.Dense(1).apply({"params": p}, batch["x"]) - batch["y"]) / 0.5
        return jnp.sum(err * err) / ROWS

    ref = jax.grad(full)(params)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("step", [scanned, dispatched, temperature_only])
def test_closing_over_a_traced_value_on_an_explicit_mesh_says_what_to_do(step):
    mesh, variables, batch = _setup("explicit")
    args = (variables["params"], variables["batch_stats"], batch, jnp.float32(0.5))
    if step is temperature_only:
        params = nn.Dense(1).init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
        t = jnp.float32(0.5)  # committed to the mesh, as a sharded step's argument is
        args = jax.device_put((params, batch, t), NamedSharding(mesh, P()))
        args = (args[0], batch, args[2])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=FIX) as info:
        jax.jit(step).trace(*args)
    assert "\n" not in str(info.value)
