"""A loss_fn closing over a jitted step's traced values on the local path
(issue #44): linen BatchNorm reading its running averages from the closure
(the usual TrainState pattern, also in a CNN with Conv), a traced
temperature, a dropout key. On an auto mesh JAX passes them into the
shard_map; on an explicit mesh JAX's shard_map refuses them and accum
closure-converts loss_fn (accum.closure) to pass them in. Either way: DDP
gradients, no in-loop reduction, through accumulate_gradients and
start/add/finish, on data and data x model meshes, stock layers Embed and
Conv included; the closure and the same value passed in the batch give the
same numbers. A closed-over value reaching a nested jaxpr (relu, softmax,
scan, jax.random's samplers): test_local_nested_closures.py.

On the data x model mesh the Embed and Conv weights stay replicated: JAX asks
for an out_sharding for a Conv kernel sharded over "model" (closure or not),
and a closure-converted Embed's table sharded over "model" fails the same way
in its backward scatter (the trace outside the shard_map, without a mesh,
records no out_sharding for it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

nn = pytest.importorskip("flax.linen")
from accum_tests_closure_cases import (  # noqa: E402 - registered by conftest where Flax is
    LAYERS,
    MESHES,
    ROWS,
    N,
    check_layer_case,
    ddp_grads,
    device_groups,
    layer_case,
    mechanism,
    mesh_named,
)


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        # No bias before the batch norm: the norm subtracts its mean, so that
        # bias's gradient is zero and any comparison of it compares float noise.
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(8, use_bias=False)(x))
        return nn.Dense(1)(nn.relu(x))


def _setup(name):
    mesh = mesh_named(name)
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (ROWS, 4)), "y": jax.random.normal(key_y, (ROWS, 1))}
    variables = Model().init(jax.random.key(0), batch["x"][:1])
    variables = jax.device_put(variables, NamedSharding(mesh, P()))
    if "model" in mesh.axis_names:  # a weight sharded over the model axis, kept there
        kernel = variables["params"]["Dense_0"]["kernel"]
        variables["params"]["Dense_0"]["kernel"] = jax.device_put(
            kernel, NamedSharding(mesh, P(None, "model"))
        )
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


def _ddp_reference(variables, batch, temperature, devices):
    """Each device's rows of each microbatch (accum.local) through BatchNorm."""
    variables, batch = jax.device_get((variables, batch))
    loss_fn = make_loss(variables["batch_stats"], temperature)
    return ddp_grads(loss_fn, variables["params"], device_groups(batch, devices))


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("step", [scanned, dispatched])
def test_closing_over_batch_stats_and_temperature(step, mesh_name):
    mesh, variables, batch = _setup(mesh_name)
    args = (variables["params"], variables["batch_stats"], batch, jnp.float32(0.5))
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, *args)
        grads = compiled(*args)
    ref = _ddp_reference(variables, batch, 0.5, mesh.shape["data"])
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    if "model" in mesh.axis_names:  # the model-sharded weight's gradient stayed sharded
        kernel = grads["Dense_0"]["kernel"]
        assert kernel.sharding.spec == P(None, "model"), kernel.sharding
    if step is scanned:  # no gradient-sized reduction inside the microbatch loop
        hlo_tools.assert_reduced_once_per_step(compiled.as_text())


class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8)(x))
        return nn.Dense(1)(nn.Dropout(0.5, deterministic=False)(h))


def _dropout_loss(scale_of):
    """loss_fn(params, mb, rng) scaling the error by `scale_of(mb)`."""

    def loss_fn(p, mb, rng):
        out = Dropped().apply({"params": p}, mb["x"], rngs={"dropout": rng})
        err = (out - mb["y"]) * scale_of(mb)
        return jnp.sum(err * err), {"weight": jnp.float32(out.shape[0])}

    return loss_fn


def test_a_closed_over_scale_and_the_same_scale_in_the_batch_agree_with_dropout():
    """On an explicit mesh a closed-over scale takes the closure-converted
    shard_map, the same scale in the batch the plain one: same rows, dropout
    keys, gradients."""
    mesh, _, batch = _setup("explicit_data8")
    params = Dropped().init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    params, scale = jax.device_put((params, jnp.float32(3.0)), NamedSharding(mesh, P()))
    rng = jax.device_put(jax.random.key(7), NamedSharding(mesh, P()))

    def closed(p, b, s, r):
        loss_fn = _dropout_loss(lambda mb: s)
        return accum.accumulate_gradients(loss_fn, p, b, num_microbatches=N, rng=r)

    def passed(p, b, s, r):
        loss_fn = _dropout_loss(lambda mb: mb["scale"])
        b = {**b, "scale": s}  # a 0-d batch leaf: every microbatch gets it
        return accum.accumulate_gradients(loss_fn, p, b, num_microbatches=N, rng=r)

    with jax.set_mesh(mesh):
        results = [accum.compile_checked(f, params, batch, scale, rng) for f in (closed, passed)]
        (loss_c, _, grads_c), (loss_p, _, grads_p) = (c(params, batch, scale, rng) for c in results)
    np.testing.assert_allclose(float(loss_c), float(loss_p), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_p), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    # Dropout did drop: without it the loss would differ.
    assert not np.isclose(float(loss_c), float(_no_dropout_loss(params, batch, 3.0)), rtol=1e-3)
    hlo_tools.assert_reduced_once_per_step(results[0].as_text())
    with jax.set_mesh(mesh):  # which mechanism each took: both the shard_map,
        jaxprs = [str(jax.make_jaxpr(f)(params, batch, scale, rng)) for f in (closed, passed)]
    assert all(j.count("shard_map[") == 1 for j in jaxprs), jaxprs
    # the closure converted (its jaxpr traced outside: no varying types) ...
    assert "check_vma=False" in jaxprs[0] and "check_vma=True" in jaxprs[1]


def test_a_closed_over_dropout_key():
    """A PRNG key closed over (not accum's rng), every device's rows dropped
    with that same key, as the same key passed in the batch (a 0-d leaf) gives.
    It reaches jax.random's jitted sampler (a nested jaxpr, re-traced by
    accum.retype): the closure-converted shard_map takes it."""
    mesh, _, batch = _setup("explicit_data8")
    params = Dropped().init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    params = jax.device_put(params, NamedSharding(mesh, P()))
    key = jax.device_put(jax.random.key(7), NamedSharding(mesh, P()))

    def loss_of(p, mb, k):
        return _dropout_loss(lambda mb: 1.0)(p, mb, k)

    def closed(p, b, k):
        return accum.accumulate_gradients(lambda p, mb: loss_of(p, mb, k), p, b, num_microbatches=N)

    def passed(p, b, k):
        b = {**b, "key": k}
        return accum.accumulate_gradients(
            lambda p, mb: loss_of(p, mb, mb["key"]), p, b, num_microbatches=N
        )

    with jax.set_mesh(mesh):
        # Both warn (accum.contract_probe, accum.contract): each microbatch draws the
        # same masks; that is the behaviour compared here. (The first trace warns:
        # compile_checked reuses it.)
        with pytest.warns(RuntimeWarning, match="PRNG key") as caught:
            assert mechanism(closed, (params, batch, key)) == "converted"
            compiled = [accum.compile_checked(f, params, batch, key) for f in (closed, passed)]
        assert {"closes over" in str(w.message) for w in caught} == {True, False}
        (loss_c, _, grads_c), (loss_p, _, grads_p) = (c(params, batch, key) for c in compiled)
    np.testing.assert_allclose(float(loss_c), float(loss_p), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_p), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert not np.isclose(float(loss_c), float(_no_dropout_loss(params, batch, 1.0)), rtol=1e-3)
    hlo_tools.assert_reduced_once_per_step(compiled[0].as_text())


def _no_dropout_loss(params, batch, scale):
    params, batch = jax.device_get((params, batch))
    x = nn.relu(nn.Dense(8).apply({"params": params["Dense_0"]}, batch["x"]))
    out = nn.Dense(1).apply({"params": params["Dense_1"]}, x)
    return jnp.mean(((out - batch["y"]) * scale) ** 2)


@pytest.mark.parametrize("mesh_name", ["auto_data8", "explicit_data8"])
def test_closing_over_a_traced_scalar_temperature(mesh_name):
    """Stock Dense (bias: the tags refuse it, local path) and a traced temperature."""
    mesh, _, batch = _setup(mesh_name)
    params = nn.Dense(4).init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    params, temperature = jax.device_put((params, jnp.float32(0.5)), NamedSharding(mesh, P()))

    def step(params, batch, temperature):
        def loss_fn(p, mb):
            err = (nn.Dense(4).apply({"params": p}, mb["x"]) - mb["y"]) / temperature
            return jnp.sum(err * err), {"weight": jnp.float32(err.shape[0])}

        plan = accum.choose_path(
            loss_fn, params, batch, num_microbatches=N, plan=accum.plan_for(params, batch)
        )
        assert plan.path == "local", plan.summary()
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)

    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, params, batch, temperature)
        _, _, grads = compiled(params, batch, temperature)
    params, batch = jax.device_get((params, batch))

    def full(p):
        err = (nn.Dense(4).apply({"params": p}, batch["x"]) - batch["y"]) / 0.5
        return jnp.sum(err * err) / ROWS

    ref = jax.grad(full)(params)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    hlo_tools.assert_reduced_once_per_step(compiled.as_text())


CASES = [(name, "explicit_data8") for name in LAYERS] + [
    ("Embed", "explicit_data4_model2"),
    ("Conv", "explicit_data4_model2"),
]


@pytest.mark.parametrize(("name", "mesh_name"), CASES)
def test_stock_layers_closing_over_a_scale_on_an_explicit_mesh(name, mesh_name):
    """Each layer, Embed and Conv included, on the shard_map: closure-converted
    where JAX refuses the closed-over scale (always on the data mesh; on the
    data x model mesh JAX 0.10.2 refuses it, 0.12 takes it itself)."""
    mesh = mesh_named(mesh_name)
    step, loss_of, args = layer_case(name, mesh)
    with jax.set_mesh(mesh):
        took = mechanism(step, args)
    assert took == "converted" if mesh_name == "explicit_data8" else took != "vmap"
    check_layer_case(step, loss_of, args, mesh)


class CNN(nn.Module):
    """A CNN as Flax users write one: Conv, BatchNorm, relu, pooled, Dense."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Conv(8, (3,), use_bias=False)(x)  # no bias before the norm (see Model)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(jnp.mean(nn.relu(x), axis=1))


def _cnn_setup(mesh_name):
    """(mesh, variables, batch); the weights replicated (on a data x model mesh
    too: JAX's Conv cannot take a model-sharded kernel without an out_sharding)."""
    mesh = mesh_named(mesh_name)
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (ROWS, 6, 3)), "y": jax.random.normal(key_y, (ROWS, 1))}
    variables = CNN().init(jax.random.key(0), batch["x"][:1], train=False)
    variables = jax.device_put(variables, NamedSharding(mesh, P()))
    return mesh, variables, jax.device_put(batch, NamedSharding(mesh, P("data")))


def make_cnn_loss(batch_stats):
    """loss_fn closing over the step's running averages and returning the new
    ones, weighted by rows, in the aux (examples/flax/batchnorm.py)."""

    def loss_fn(params, mb):
        variables = {"params": params, "batch_stats": batch_stats}
        out, updates = CNN().apply(variables, mb["x"], train=True, mutable=["batch_stats"])
        err, rows = out - mb["y"], jnp.float32(out.shape[0])
        stats = jax.tree.map(lambda s: s * rows, updates["batch_stats"])
        return jnp.sum(err * err), {"weight": rows, "batch_stats": stats}

    return loss_fn


def cnn_scanned(params, batch_stats, batch):
    """(grads, new running averages) of one step, as batchnorm.py's train_step."""
    _, aux, grads = accum.accumulate_gradients(
        make_cnn_loss(batch_stats), params, batch, num_microbatches=N
    )
    return grads, jax.tree.map(lambda s: s / aux["weight"], aux["batch_stats"])


def cnn_dispatched(params, batch_stats, batch):
    """The same through start/add/finish in one jit."""
    loss_fn = make_cnn_loss(batch_stats)
    microbatches = accum.split_microbatches(batch, N)
    acc = accum.start(loss_fn, params, jax.tree.map(lambda x: x[0], microbatches))
    for i in range(N):
        acc = accum.add(acc, loss_fn, params, jax.tree.map(lambda x, i=i: x[i], microbatches))
    _, aux, grads = accum.finish(acc)
    return grads, jax.tree.map(lambda s: s / aux["weight"], aux["batch_stats"])


@pytest.mark.parametrize("mesh_name", ["explicit_data8", "explicit_data4_model2"])
@pytest.mark.parametrize("step", [cnn_scanned, cnn_dispatched])
def test_a_cnn_closing_over_its_batch_stats_on_an_explicit_mesh(step, mesh_name):
    """Conv + BatchNorm, loss_fn closing over batch_stats (the closure-converted
    shard_map): DDP gradients (the statistics of each device's rows of each
    microbatch) and running averages (their rows-weighted mean), no in-loop
    reduction."""
    mesh, variables, batch = _cnn_setup(mesh_name)
    args = (variables["params"], variables["batch_stats"], batch)
    with jax.set_mesh(mesh):
        assert mechanism(step, args) == "converted"
        compiled = accum.compile_checked(step, *args)
        grads, stats = compiled(*args)
    variables, batch = jax.device_get((variables, batch))
    loss_fn = make_cnn_loss(variables["batch_stats"])
    groups = device_groups(batch, mesh.shape["data"])
    ref = ddp_grads(loss_fn, variables["params"], groups)
    ref_stats = jax.tree.map(
        lambda *s: sum(s) / ROWS,
        *[loss_fn(variables["params"], b)[1]["batch_stats"] for b in groups],
    )
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(stats), jax.tree.leaves(ref_stats), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The running averages moved (momentum 0.9 from zeros and ones): the aux carried them.
    old = variables["batch_stats"]["BatchNorm_0"]
    assert not np.allclose(stats["BatchNorm_0"]["mean"], old["mean"])
    assert not np.allclose(stats["BatchNorm_0"]["var"], old["var"])
    if step is cnn_scanned:  # no gradient-sized reduction inside the microbatch loop
        hlo_tools.assert_reduced_once_per_step(compiled.as_text())
