"""Tensor parallelism with stock Flax layers (issue #54, deliverable 4).

A linen MLP whose first `nn.Dense` is column parallel by `nn.with_partitioning`
(its boxes kept, as Flax's guide does; or taken off, the arrays placed by hand:
"placed"), and the same MLP in nnx by `nnx.with_partitioning`, on data=4 x
model=2, explicit and auto: the default
batch axes are the ones that shard the batch (('data',), never 'model'), the
gradients are the full batch's `jax.grad` (f32), the gradient reductions over
'data' run once per step after the loop, and the training step
`compile_checked` returns runs step after step on its own outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402 - after the skip
from flax import nnx  # noqa: E402

ROWS, STEPS = 32, 5
COLUMN = (None, "model")  # the first layer's kernel: output features over 'model'


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(
            16,
            kernel_init=nn.with_partitioning(init, COLUMN),
            bias_init=nn.with_partitioning(nn.initializers.normal(0.1), ("model",)),
        )(x)
        return nn.Dense(3)(nn.relu(h))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(
            8,
            16,
            kernel_init=nnx.with_partitioning(init, COLUMN),
            bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("model",)),
            rngs=rngs,
        )
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _mesh(kind):
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis, axis))


def _linen(mesh, x):
    model = LinenMLP()
    boxed = model.init(jax.random.key(0), x[:1])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(boxed))
    params = jax.device_put(boxed, shardings)  # nn.Partitioned boxes kept

    def logits(p, x):
        return model.apply(p, x)

    return params, logits


def _linen_placed(mesh, x):
    """The linen MLP's parameters placed by hand: plain arrays, no annotation."""
    params, logits = _linen(mesh, x)
    unboxed = jax.tree.map(
        lambda b: b.value if _is_partitioned(b) else b, params, is_leaf=_is_partitioned
    )
    return unboxed, logits


def _is_partitioned(x):
    return isinstance(x, nn.Partitioned)


def _nnx(mesh, x):
    with jax.set_mesh(mesh):  # nnx.with_partitioning places each parameter
        graphdef, params = nnx.split(NnxMLP(nnx.Rngs(0)))
    # Every parameter on the mesh as annotated (the second layer's: replicated).
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    placed = jax.tree.map(
        lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), nnx.to_pure_dict(params), specs
    )
    nnx.replace_by_pure_dict(params, placed)

    def logits(p, x):
        return nnx.merge(graphdef, p)(x)

    return params, logits


def _case(kind, mesh_kind):
    mesh = _mesh(mesh_kind)
    x = jax.random.normal(jax.random.key(1), (ROWS, 8))
    y = jax.random.randint(jax.random.key(2), (ROWS,), 0, 3)
    params, logits = {"linen": _linen, "placed": _linen_placed, "nnx": _nnx}[kind](mesh, x)
    batch = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))

    def loss_fn(p, mb):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits(p, mb["x"]), mb["y"])
        return jnp.sum(loss), {"weight": jnp.float32(mb["y"].shape[0])}

    return mesh, loss_fn, params, batch


CASES = ["linen-explicit", "linen-auto", "placed-auto", "nnx-explicit", "nnx-auto"]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    kind, mesh_kind = request.param.split("-")
    mesh, loss_fn, params, batch = _case(kind, mesh_kind)
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2),
            params,
            batch,
        )
        grads = compiled(params, batch)[2]
    return mesh, loss_fn, params, batch, compiled, grads


def test_default_batch_axes_are_the_batchs_never_model(case):
    mesh, _, params, batch, _, _ = case
    with jax.set_mesh(mesh):
        plan = accum.plan_for(params, batch)
    assert plan.batch_axes == ("data",), plan.batch_axes


def test_gradients_are_the_full_batch_grad(case):
    _, loss_fn, params, batch, _, grads = case
    # One jax.grad over the whole batch on one device, no mesh.
    params, batch = jax.device_get((params, batch))
    ref = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0] / ROWS))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_data_reductions_once_per_step_and_model_stays_sharded(case):
    mesh, _, params, _, compiled, grads = case
    text = compiled.as_text()
    # The plan traced inside the step deferred 'data' alone (the loop's mark).
    assert "accum_microbatch_loop[data|data=4,model=2]" in text
    assert not accum.in_loop_reductions(text)
    # In the loop only tensor parallelism's own all-reduce over 'model' of the head's
    # partial output (f32[4,3]: 4 rows a device x 3 classes, 12 elements); every
    # gradient (the smallest reduced one, the head's kernel: 48) after the loop.
    outside = hlo_tools.assert_reduced_once_per_step(text, max_in_loop_elements=12)
    shape = {"data": 4, "model": 2}
    assert any(hlo_tools.spans_mesh_axis(c, shape, "data") for c in outside)
    assert not any(hlo_tools.spans_mesh_axis(c, shape, "model") for c in outside)
    if mesh.axis_types[0] == AxisType.Explicit:  # the types say where each gradient lives
        for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
            assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)


def test_compiled_train_step_runs_many_steps_unpinned(case):
    mesh, loss_fn, params, batch, _, _ = case
    optimizer = optax.adamw(1e-2)

    def step(p, s, b):
        return accum.train_step(loss_fn, optimizer, p, s, b, num_microbatches=2)

    with jax.set_mesh(mesh):
        state = optimizer.init(params)
        compiled = accum.compile_checked(step, params, state, batch)
        losses = []
        for _ in range(STEPS):  # its outputs fed back in, no out_shardings pinned
            params, state, loss, _ = compiled(params, state, batch)
            losses.append(float(loss))
    assert losses[-1] < losses[0], losses
