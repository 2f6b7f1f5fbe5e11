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
scan, jax.random's samplers) cannot be closure-converted: accum maps each
device's rows with jax.vmap instead (accum.local_mapped), and where that
cannot map the layer either (Embed, Conv), one line says what to do.

On the data x model mesh the Embed and Conv weights stay replicated: JAX asks
for an out_sharding for a Conv kernel sharded over "model" (closure or not),
and a closure-converted Embed's table sharded over "model" fails the same way
in its backward scatter (the trace outside the shard_map, without a mesh,
records no out_sharding for it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
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
    It reaches jax.random's jitted sampler (a nested jaxpr): the vmap takes it."""
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
        compiled = [accum.compile_checked(f, params, batch, key) for f in (closed, passed)]
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


# name: (module, input rows (ROWS, ...)), each called the usual way inside loss_fn.
LAYERS = {
    "Dense": (lambda: nn.Dense(4), (4,)),
    "LayerNorm": (lambda: nn.LayerNorm(), (16,)),  # 16 features: a gradient-sized scale
    "RMSNorm": (lambda: nn.RMSNorm(), (16,)),
    "MultiHeadDotProductAttention": (
        lambda: nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4),
        (3, 4),
    ),
    "scan_remat": (ScannedBlocks, (4,)),
    "Embed": (lambda: nn.Embed(16, 4), ()),  # a gather
    "Conv": (lambda: nn.Conv(4, (2,)), (3, 4)),  # a convolution
}


def _layer_case(name, mesh, squash=jnp.tanh):
    """(step, loss_of, args): `step` accumulates loss_fn closing over a traced
    scale, `squash(module(x) * scale)` squared. On a data x model mesh the scale
    is a vector over the 4 features (JAX takes a scalar into the shard_map there
    itself) and the embedding table is sharded over "model" (a Conv kernel
    cannot be: JAX asks for an out_sharding, closure or not)."""
    make, shape = LAYERS[name]
    module = make()
    if name == "Embed":
        x = jnp.arange(ROWS, dtype=jnp.int32) % 16
    else:
        x = jax.random.normal(jax.random.key(1), (ROWS, *shape))
    params = module.init(jax.random.key(0), x[:1])["params"]
    scale = jnp.full((4,), 2.0) if "model" in mesh.axis_names else jnp.float32(2.0)
    params, scale = jax.device_put((params, scale), NamedSharding(mesh, P()))
    batch = jax.device_put({"x": x}, NamedSharding(mesh, P("data")))

    def loss_of(p, mb, s):
        out = squash(module.apply({"params": p}, mb["x"]) * s)
        return jnp.sum(out * out), {"weight": jnp.float32(mb["x"].shape[0])}

    def step(params, batch, scale):
        loss_fn = lambda p, mb: loss_of(p, mb, scale)  # noqa: E731 - the closure under test
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)

    return step, loss_of, (params, batch, scale)


def _mechanism(step, args):
    """Which local mechanism `step` traced to: "converted" (the shard_map of the
    closure-converted loss_fn, no varying types), "shard_map" or "vmap"."""
    text = str(jax.make_jaxpr(step)(*args))
    if "shard_map[" not in text:
        return "vmap"
    return "converted" if "check_vma=False" in text else "shard_map"


def _check_layer_case(step, loss_of, args, mesh):
    """Full-batch gradients, no in-loop reduction."""
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, *args)
        _, _, grads = compiled(*args)
    params, batch, scale = jax.device_get(args)
    ref = jax.grad(lambda p: loss_of(p, batch, scale)[0] / ROWS)(params)
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
    mesh = _mesh(mesh_name)
    step, loss_of, args = _layer_case(name, mesh)
    with jax.set_mesh(mesh):
        mechanism = _mechanism(step, args)
    assert mechanism == "converted" if mesh_name == "explicit_data8" else mechanism != "vmap"
    _check_layer_case(step, loss_of, args, mesh)


def _scanned_squash(h):
    """A closed-over value's product through a lax.scan: a nested jaxpr."""
    return lax.scan(lambda c, _: (jnp.sin(c), None), h, None, length=2)[0]


# A closed-over value reaching a nested jaxpr: custom_jvp (relu), jit
# (log_softmax), scan. Closure conversion cannot retype it; the vmap takes it.
NESTED = {"relu": jax.nn.relu, "log_softmax": jax.nn.log_softmax, "scan": _scanned_squash}


@pytest.mark.parametrize("squash", list(NESTED))
def test_a_closed_over_value_reaching_a_nested_jaxpr_takes_the_vmap(squash):
    mesh = _mesh("explicit_data8")
    step, loss_of, args = _layer_case("Dense", mesh, NESTED[squash])
    with jax.set_mesh(mesh):
        assert _mechanism(step, args) == "vmap"
    _check_layer_case(step, loss_of, args, mesh)


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
    mesh = _mesh(mesh_name)
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
        assert _mechanism(step, args) == "converted"
        compiled = accum.compile_checked(step, *args)
        grads, stats = compiled(*args)
    variables, batch = jax.device_get((variables, batch))
    loss_fn = make_cnn_loss(variables["batch_stats"])
    block = ROWS // mesh.shape["data"]
    rows = [
        np.arange(d * block + i, (d + 1) * block, N)
        for d in range(mesh.shape["data"])
        for i in range(N)
    ]
    groups = [jax.tree.map(lambda x, g=g: x[g], batch) for g in rows]
    ref = jax.tree.map(
        lambda *g: sum(g) / ROWS,
        *[jax.grad(lambda p, b=b: loss_fn(p, b)[0])(variables["params"]) for b in groups],
    )
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


@pytest.mark.parametrize("name", ["Embed", "Conv"])
def test_a_closure_neither_mechanism_takes_says_what_to_do(name):
    """Embed or Conv with a closed-over value reaching a nested jaxpr (relu):
    closure conversion cannot retype it and jax.vmap cannot map the layer; one
    line says what to do."""
    mesh = _mesh("explicit_data8")
    step, _, args = _layer_case(name, mesh, jax.nn.relu)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=FIX) as info:
        jax.jit(step).trace(*args)
    message = str(info.value)
    assert "\n" not in message and "closure conversion" in message and "jax.vmap" in message
