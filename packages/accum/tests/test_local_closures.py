"""A loss_fn closing over a jitted step's traced values on the local path
(issue #44): linen BatchNorm reading its running averages from the closure
(the usual TrainState pattern), a traced temperature, a dropout key. On an
auto mesh JAX passes them into the shard_map; on an explicit mesh JAX's
shard_map refuses them and accum maps each device's rows with jax.vmap
instead (accum.local_mapped). Either way: DDP gradients, no in-loop
reduction, through accumulate_gradients and start/add/finish, on data and
data x model meshes; the two mechanisms give the same numbers. Where JAX's
explicit sharding rules cannot map a layer (Embed's gather), a one-line error
says what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

nn = pytest.importorskip("flax.linen")
N, ROWS = 2, 64  # microbatches, batch rows
FIX = "pass it through the params or the batch"
MESHES = {  # name: (axis type, model axis size)
    "auto_data8": (AxisType.Auto, 1),
    "explicit_data8": (AxisType.Explicit, 1),
    "explicit_data4_model2": (AxisType.Explicit, 2),
}


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        # No bias before the batch norm: the norm subtracts its mean, so that
        # bias's gradient is zero and any comparison of it compares float noise.
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(8, use_bias=False)(x))
        return nn.Dense(1)(nn.relu(x))


def _mesh(name):
    axis, model = MESHES[name]
    if model == 1:
        return jax.make_mesh((8,), ("data",), axis_types=(axis,))
    return jax.make_mesh((8 // model, model), ("data", "model"), axis_types=(axis, axis))


def _setup(name):
    mesh = _mesh(name)
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
    block = ROWS // devices
    groups = [
        np.arange(d * block + i, (d + 1) * block, N) for d in range(devices) for i in range(N)
    ]
    grads = [
        jax.grad(lambda p, g=g: loss_fn(p, jax.tree.map(lambda x: x[g], batch))[0])(
            variables["params"]
        )
        for g in groups
    ]
    return jax.tree.map(lambda *g: sum(g) / ROWS, *grads)


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


def test_the_mapped_and_shard_mapped_mechanisms_agree_with_dropout():
    """On an explicit mesh a closed-over scale takes the mapped mechanism, the
    same scale in the batch the shard_map: same rows, dropout keys, gradients."""
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
    with jax.set_mesh(mesh):  # which mechanism each took
        jaxprs = [str(jax.make_jaxpr(f)(params, batch, scale, rng)) for f in (closed, passed)]
    assert "shard_map" not in jaxprs[0] and "shard_map" in jaxprs[1]


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


class ScannedBlocks(nn.Module):
    """Two tanh(Dense) blocks through nn.scan over nn.remat."""

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, carry, _):
                return nn.tanh(nn.Dense(4)(carry)), None

        scan = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        return scan()(x, None)[0]


# name: (module, input rows (ROWS, ...)); the mapped mechanism takes each.
MAPPED = {
    "Dense": (lambda: nn.Dense(4), (4,)),
    "LayerNorm": (lambda: nn.LayerNorm(), (16,)),  # 16 features: a gradient-sized scale
    "RMSNorm": (lambda: nn.RMSNorm(), (16,)),
    "MultiHeadDotProductAttention": (
        lambda: nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4),
        (3, 4),
    ),
    "scan_remat": (ScannedBlocks, (4,)),
}
# JAX's explicit sharding rules cannot map these over the device rows.
REFUSED = {"Embed": (lambda: nn.Embed(16, 4), ()), "Conv": (lambda: nn.Conv(4, (2,)), (3, 4))}


def _layer_case(name, mesh):
    make, shape = {**MAPPED, **REFUSED}[name]
    module = make()
    if name == "Embed":
        x = jnp.arange(ROWS, dtype=jnp.int32) % 16
    else:
        x = jax.random.normal(jax.random.key(1), (ROWS, *shape))
    params = module.init(jax.random.key(0), x[:1])["params"]
    params, scale = jax.device_put((params, jnp.float32(2.0)), NamedSharding(mesh, P()))
    batch = jax.device_put({"x": x}, NamedSharding(mesh, P("data")))

    def loss_of(p, mb, s):
        out = jnp.tanh(module.apply({"params": p}, mb["x"]) * s)
        return jnp.sum(out * out), {"weight": jnp.float32(mb["x"].shape[0])}

    def step(params, batch, scale):
        loss_fn = lambda p, mb: loss_of(p, mb, scale)  # noqa: E731 - the closure under test
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)

    return step, loss_of, (params, batch, scale)


@pytest.mark.parametrize("name", list(MAPPED))
def test_stock_layers_closing_over_a_scale_on_an_explicit_mesh(name):
    mesh = _mesh("explicit_data8")
    step, loss_of, args = _layer_case(name, mesh)
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, *args)
        _, _, grads = compiled(*args)
    params, batch, scale = jax.device_get(args)
    ref = jax.grad(lambda p: loss_of(p, batch, scale)[0] / ROWS)(params)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    hlo_tools.assert_reduced_once_per_step(compiled.as_text())


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_closure_with_a_layer_vmap_cannot_map_on_an_explicit_mesh_says_what_to_do(name):
    mesh = _mesh("explicit_data8")
    step, _, args = _layer_case(name, mesh)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=FIX) as info:
        jax.jit(step).trace(*args)
    assert "\n" not in str(info.value) and "jax.vmap" in str(info.value)
