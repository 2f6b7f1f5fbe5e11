"""accumulate_gradients(prepare=...): work on the parameters done once per step.

A stacked weight split into its layers is the case the trainer runs (its unrolled
layer loop, issue 53): with `prepare` the loop's body reads each layer's own array
and never slices the stack, and the gradients are the stacked parameter's, equal
to the full batch's, on an explicit mesh (tags kept: reduced once per step) and an
auto one, and on the schedules and paths that run `prepare` per microbatch instead.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

LAYERS, WIDTH, ROWS = 3, 8, 32
SLICING = {"slice", "dynamic_slice", "squeeze", "gather"}


def split(params):
    """The stacked weight as a tuple of its layers; the output weight as it is."""
    w = params["w"]
    return {"w": tuple(w[i] for i in range(w.shape[0])), "out": params["out"]}


def loss_on_layers(view, batch):
    """Sum of squared errors of a 3-layer tanh network over the rows; weight = rows."""
    x = batch["x"]
    for w in view["w"]:
        x = jnp.tanh(x @ w)
    err = x @ view["out"] - batch["y"]
    return jnp.sum(err * err), {"weight": jnp.float32(x.shape[0])}


def full_batch(params, batch):
    loss_sum, aux = loss_on_layers(split(params), batch)
    return loss_sum / aux["weight"]


def _setup(mode):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(AxisType, mode),))
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(LAYERS, WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH),
        "out": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH),
    }
    batch = {
        "x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
    }
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    return mesh, params, batch


def _composed(loss_fn, prepare):
    """`loss_fn(prepare(params), ...)`: what `prepare` means, written out by hand."""
    return lambda params, *args: loss_fn(prepare(params), *args)


def _accumulate(params, batch, prepare, schedule="plain", n=4):
    # Without `prepare`: the same loss, composed by hand (the split inside the loop).
    loss_fn = loss_on_layers if prepare is not None else _composed(loss_on_layers, split)
    plan = accum.plan_for(params, batch)
    return accum.accumulate_gradients(
        loss_fn, params, batch, num_microbatches=n, plan=plan, prepare=prepare, schedule=schedule
    )


def _scan_bodies(jaxpr):
    """The body jaxprs of every scan in `jaxpr` (nested calls included)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        for sub in jaxprs_in_params(eqn.params):
            yield from _scan_bodies(sub)


def _slices_of_the_stack(body) -> list[str]:
    """Slicing equations in `body` (nested) whose operand is a whole stack."""
    found = []
    for eqn in body.eqns:
        shapes = [getattr(v.aval, "shape", None) for v in eqn.invars]
        if eqn.primitive.name in SLICING and (LAYERS, WIDTH, WIDTH) in shapes:
            found.append(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            found += _slices_of_the_stack(sub)
    return found


@pytest.mark.parametrize("mode", ["Explicit", "Auto"])
def test_prepare_gives_the_full_batch_gradients(mode):
    mesh, params, batch = _setup(mode)
    with jax.set_mesh(mesh):
        loss_ref, grads_ref = jax.jit(jax.value_and_grad(full_batch))(params, batch)
        step = jax.jit(lambda p, b: _accumulate(p, b, split))
        loss, aux, grads = step(params, batch)
        text = step.lower(params, batch).compile().as_text()
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    assert float(aux["weight"]) == ROWS
    for name in ("w", "out"):
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6)
    assert grads["w"].shape == (LAYERS, WIDTH, WIDTH)  # the stacked parameter's gradient
    if mode == "Explicit":
        hlo_tools.assert_reduced_once_per_step(text)


def test_the_loop_reads_the_layers_without_slicing_the_stack():
    mesh, params, batch = _setup("Explicit")
    with jax.set_mesh(mesh):
        hoisted = jax.make_jaxpr(lambda p, b: _accumulate(p, b, split))(params, batch)
        per_microbatch = jax.make_jaxpr(lambda p, b: _accumulate(p, b, None))(params, batch)
    bodies = list(_scan_bodies(hoisted.jaxpr))
    assert bodies and all(_slices_of_the_stack(body) == [] for body in bodies)
    # Without `prepare`, the same loss slices the stack in every microbatch: what the
    # check above would find if the split ran inside the loop.
    assert any(_slices_of_the_stack(body) for body in _scan_bodies(per_microbatch.jaxpr))


@pytest.mark.parametrize("schedule", ["fused", "overlapped"])
def test_schedules_that_run_prepare_per_microbatch_keep_the_numbers(schedule):
    mesh, params, batch = _setup("Explicit")
    with jax.set_mesh(mesh):
        _, grads_ref = jax.jit(jax.value_and_grad(full_batch))(params, batch)
        _, _, grads = jax.jit(lambda p, b: _accumulate(p, b, split, schedule))(params, batch)
    for name in ("w", "out"):
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6)


def test_the_local_path_runs_prepare_per_microbatch_with_the_same_numbers():
    """A bias add of a reduced weight onto data-sharded rows cannot carry the tags
    (ShardingTypeError), so accum takes the local path, where `prepare` runs inside
    each microbatch's shard_map: the gradients are still the full batch's."""

    def with_bias(view, batch):
        x = batch["x"]
        for w in view["w"]:
            x = jnp.tanh(x @ w) + view["out"][0]
        err = x - batch["y"]
        return jnp.sum(err * err), {"weight": jnp.float32(x.shape[0])}

    def full(params, batch):
        loss_sum, aux = with_bias(split(params), batch)
        return loss_sum / aux["weight"]

    mesh, params, batch = _setup("Explicit")
    with jax.set_mesh(mesh):
        _, grads_ref = jax.jit(jax.value_and_grad(full))(params, batch)
        plan = accum.plan_for(params, batch)

        def step(p, b):
            return accum.accumulate_gradients(
                with_bias, p, b, num_microbatches=4, plan=plan, prepare=split
            )

        _, _, grads = jax.jit(step)(params, batch)
        chosen = accum.paths.choose_path(
            _composed(with_bias, split), params, batch,
            num_microbatches=4, plan=plan,
        )  # fmt: skip
    assert chosen.path == "local", chosen.path_reason
    for name in ("w", "out"):
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6)
