"""A closed-over value reaching a nested jaxpr on an explicit mesh (issue #44).

`jax.nn.relu`/`log_softmax` of it (a custom_jvp and a jit), a `scan`, `cond`,
`while`, `checkpoint`, a closed-over dropout key reaching `jax.random`'s
jitted samplers: accum.closure's jaxpr keeps the explicit mesh's types in
those nested jaxprs, and accum.retype re-traces them inside the shard_map.
So stock Embed and Conv, which jax.vmap (accum.local_mapped) cannot map, take
them on data=8 and data=4 x model=2 meshes: full-batch (or, with dropout or
batch statistics, DDP) gradients, no gradient reduction in the microbatch
loop, and relu's derivative at exactly 0 is JAX's own (its custom_jvp rule
kept, not max's 0.5).

What accum.retype does not rebuild, a custom_vjp, still fails the conversion
loudly: jax.vmap takes Dense, and for Embed or Conv one line says what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

nn = pytest.importorskip("flax.linen")
import accum_tests_closure_cases as cases  # noqa: E402 - registered by conftest where Flax is

N, ROWS = cases.N, cases.ROWS  # microbatches, batch rows

EXPLICIT = ["explicit_data8", "explicit_data4_model2"]


def _scanned(h):
    return lax.scan(lambda c, _: (jnp.sin(c), None), h, None, length=2)[0]


def _conditional(h):
    # A traced predicate that holds for every row (finite inputs): a real cond.
    return lax.cond(jnp.isfinite(jnp.sum(h)), jnp.sin, jnp.cos, h)


def _looped(h):
    # Reverse mode cannot go through a while loop: it runs on a stopped copy.
    step = lambda c: (c[0] + 1, c[1] * 0.5)  # noqa: E731
    return h * lax.while_loop(lambda c: c[0] < 2, step, (0, lax.stop_gradient(h)))[1]


@jax.custom_vjp
def _vjp_sin(h):
    return jnp.sin(h)


_vjp_sin.defvjp(lambda h: (jnp.sin(h), jnp.cos(h)), lambda cos, g: (g * cos,))

# A closed-over value's product (the layer's output times the scale) through
# each kind of nested jaxpr accum.retype re-traces.
NESTED = {
    "relu": jax.nn.relu,  # custom_jvp + jit
    "log_softmax": jax.nn.log_softmax,  # jit
    "scan": _scanned,
    "cond": _conditional,
    "while": _looped,
    "checkpoint": jax.checkpoint(lambda h: jnp.sin(h) * h),
}


@pytest.mark.parametrize("squash", list(NESTED))
def test_a_closed_over_value_reaching_a_nested_jaxpr_takes_the_shard_map(squash):
    mesh = cases.mesh_named("explicit_data8")
    step, loss_of, args = cases.layer_case("Dense", mesh, NESTED[squash])
    with jax.set_mesh(mesh):
        assert cases.mechanism(step, args) == "converted"
    cases.check_layer_case(step, loss_of, args, mesh)


@pytest.mark.parametrize("mesh_name", EXPLICIT)
@pytest.mark.parametrize("name", ["Embed", "Conv"])
def test_embed_and_conv_closing_over_a_value_through_relu(name, mesh_name):
    """Before accum.retype: a one-line error (the vmap cannot map these layers).
    On the data x model mesh JAX 0.12 takes the closed-over vector itself (the
    plain shard_map), 0.10.2 refuses it (the converted one)."""
    mesh = cases.mesh_named(mesh_name)
    step, loss_of, args = cases.layer_case(name, mesh, jax.nn.relu)
    with jax.set_mesh(mesh):
        took = cases.mechanism(step, args)
    assert took == "converted" if mesh_name == "explicit_data8" else took != "vmap"
    cases.check_layer_case(step, loss_of, args, mesh)


def test_relu_at_exact_zeros_keeps_its_derivative():
    """Half the rows are zeros, so with Dense's zero bias relu sees exactly 0:
    its custom_jvp says the derivative is 0 there (max(x, 0) would give 0.5),
    and the bias gradient is the one plain jax.grad gives."""
    mesh = cases.mesh_named("explicit_data8")
    _, _, (params, _, scale) = cases.layer_case("Dense", mesh, jax.nn.relu)
    x = jax.random.normal(jax.random.key(2), (ROWS, 4)) * (jnp.arange(ROWS) % 2)[:, None]
    batch = jax.device_put({"x": x}, NamedSharding(mesh, P("data")))

    def loss_of(p, mb, s):  # linear in relu's output: its derivative reaches the bias
        out = jax.nn.relu(nn.Dense(4).apply({"params": p}, mb["x"]) * s)
        return jnp.sum(out), {"weight": jnp.float32(mb["x"].shape[0])}

    def step(params, batch, scale):
        loss_fn = lambda p, mb: loss_of(p, mb, scale)  # noqa: E731 - the closure under test
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)

    with jax.set_mesh(mesh):
        assert cases.mechanism(step, (params, batch, scale)) == "converted"
        _, _, grads = accum.compile_checked(step, params, batch, scale)(params, batch, scale)
    params, x, scale = jax.device_get((params, x, scale))
    ref = jax.grad(lambda p: loss_of(p, {"x": x}, scale)[0] / ROWS)(params)
    max_rule = jax.grad(
        lambda p: jnp.sum(jnp.maximum(nn.Dense(4).apply({"params": p}, x) * scale, 0.0)) / ROWS
    )(params)
    assert not np.allclose(ref["bias"], max_rule["bias"])  # the zeros do matter
    np.testing.assert_allclose(np.asarray(grads["bias"]), ref["bias"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grads["kernel"]), ref["kernel"], rtol=2e-4, atol=1e-6)


class ConvDropped(nn.Module):
    """Conv, relu, Dropout, pooled, Dense: a CNN trained with dropout."""

    train: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.5, deterministic=not self.train)(nn.relu(nn.Conv(4, (2,))(x)))
        return nn.Dense(1)(jnp.mean(h, axis=1))


def _conv_dropout_loss(params, mb, key, train=True):
    """The usual Flax step's loss: the step's dropout key in `rngs`."""
    out = ConvDropped(train).apply({"params": params}, mb["x"], rngs={"dropout": key})
    err = out - mb["y"]
    return jnp.sum(err * err), {"weight": jnp.float32(out.shape[0])}


@pytest.mark.parametrize("mesh_name", EXPLICIT)
def test_a_conv_model_closing_over_its_dropout_key(mesh_name):
    """loss_fn closes over the jitted step's dropout key (not accum's rng), so
    every device's rows of every microbatch are dropped with that same key:
    DDP gradients over those row groups, no in-loop reduction."""
    mesh = cases.mesh_named(mesh_name)
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (ROWS, 6, 3)), "y": jax.random.normal(key_y, (ROWS, 1))}
    params = ConvDropped().init(jax.random.key(0), batch["x"][:1])["params"]
    params, key = jax.device_put((params, jax.random.key(7)), NamedSharding(mesh, P()))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))

    def step(params, batch, key):
        loss_fn = lambda p, mb: _conv_dropout_loss(p, mb, key)  # noqa: E731 - the closure
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)

    with jax.set_mesh(mesh):
        assert cases.mechanism(step, (params, batch, key)) == "converted"
        compiled = accum.compile_checked(step, params, batch, key)
        _, _, grads = compiled(params, batch, key)
    hlo_tools.assert_reduced_once_per_step(compiled.as_text())
    params, batch, key = jax.device_get((params, batch, key))
    groups = cases.device_groups(batch, mesh.shape["data"])
    ref = cases.ddp_grads(lambda p, b: _conv_dropout_loss(p, b, key), params, groups)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    # Dropout did drop: without it the kernel's gradient differs.
    undropped = jax.grad(lambda p: _conv_dropout_loss(p, batch, key, train=False)[0] / ROWS)
    kernel = grads["Conv_0"]["kernel"]
    assert not np.allclose(kernel, undropped(params)["Conv_0"]["kernel"], rtol=1e-2)


@pytest.mark.parametrize("name", ["Embed", "Conv"])
def test_a_closure_reaching_a_custom_vjp_says_what_to_do(name):
    """A closed-over value reaching a custom_vjp (accum.retype rebuilds
    custom_jvp, not custom_vjp: its stored rules keep the outer types), with
    Embed or Conv (which jax.vmap cannot map): one line says what to do."""
    mesh = cases.mesh_named("explicit_data8")
    step, _, args = cases.layer_case(name, mesh, _vjp_sin)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=cases.FIX) as info:
        jax.jit(step).trace(*args)
    message = str(info.value)
    assert "\n" not in message and "closure conversion" in message and "jax.vmap" in message


def test_a_closure_reaching_a_custom_vjp_takes_the_vmap_with_dense():
    mesh = cases.mesh_named("explicit_data8")
    step, loss_of, args = cases.layer_case("Dense", mesh, _vjp_sin)
    with jax.set_mesh(mesh):
        assert cases.mechanism(step, args) == "vmap"
    cases.check_layer_case(step, loss_of, args, mesh)
