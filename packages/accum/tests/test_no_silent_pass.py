"""Issue #44: the compiled verdict judges every plan, names parameters on cached
traces; 0-d batch leaves and integer parameters get clear answers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools
import pspec_tags
from pspec_tags import TagLostError

MESH = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _put(x, *spec):
    return jax.device_put(x, NamedSharding(MESH, P(*spec)))


def _weight(mb):
    return {"weight": jnp.float32(mb["x"].shape[0])}


PARAMS = {"w": _put(jnp.ones((4, 16))), "s": _put(jnp.ones((16,)), "data")}
BATCH = {"x": _put(jnp.ones((32, 4)), "data")}


def _dense(w, mb):
    return jnp.einsum("bd,df->bf", mb["x"], w, out_sharding=P("data"))


def drops_w(p, mb):  # w's tag dropped: its gradient is all-reduced per microbatch
    h = _dense(jax.reshard(p["w"], P()), mb)
    return jnp.sum(jnp.tanh(h) * jax.reshard(p["s"], P())), _weight(mb)


def keeps_w(p, mb):
    return jnp.sum(jnp.tanh(_dense(p["w"], mb)) * jax.reshard(p["s"], P())), _weight(mb)


def _step(loss_fn, plan):
    return jax.jit(
        lambda p, b: accum.accumulate_gradients(
            loss_fn, p, b, num_microbatches=2, plan=plan, on_tag_lost="ignore"
        )
    )


def test_a_per_parameter_plan_with_a_data_sharded_leaf_still_judges_the_others():
    """(a): strict_axes == () (s is sharded over data), yet w defers data: its
    in-loop all-reduce raises, naming w; the intact model passes."""
    _per_parameter_verdicts(
        PARAMS, drops_w, keeps_w, r"^the gradient of .*\['w'\] \(float32\[[^\n]*$"
    )


def _per_parameter_verdicts(params, drops, keeps, blamed):
    """Under a per-parameter plan deferring data for some leaves only: `drops`
    raises TagLostError matching `blamed`, `keeps` passes."""
    with jax.set_mesh(MESH):
        plan = accum.plan_for(params, BATCH, per_parameter=True, path="tags")
        assert plan.strict_axes == () and plan.deferred_axes == ("data",)
        with pytest.raises(TagLostError, match=blamed):
            accum.compile_checked(_step(drops, plan), params, BATCH)
        accum.compile_checked(_step(keeps, plan), params, BATCH)


def test_c_a_plan_that_defers_nothing_says_so_and_names_the_parameter():
    with jax.set_mesh(MESH):
        plan = accum.plan_for(PARAMS, BATCH, path="tags")
    assert plan.deferred_axes == ()
    assert "defers nothing" in plan.summary() and "['s']" in plan.summary()


def test_b_auto_mesh_takes_the_local_path_with_no_in_loop_reduction():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params = jax.device_put({"w": jnp.ones((4, 16))}, NamedSharding(mesh, P()))
    batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))

    def loss_fn(p, mb):
        return jnp.sum(jnp.tanh(mb["x"] @ p["w"])), _weight(mb)

    step = jax.jit(lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2))
    with jax.set_mesh(mesh):
        plan = accum.choose_path(
            loss_fn, params, batch, num_microbatches=2, plan=accum.plan_for(params, batch)
        )
        compiled = accum.compile_checked(step, params, batch)
        _, _, grads = compiled(params, batch)
        ref = jax.grad(lambda p: loss_fn(p, batch)[0] / 32)(params)
    assert plan.path == "local" and "auto mode" in plan.summary()
    np.testing.assert_allclose(grads["w"], ref["w"], rtol=1e-5)
    assert not hlo_tools.in_loop_reductions(compiled.as_text())


def test_auto_mesh_forced_tags_path_says_every_gradient_is_reduced_per_microbatch():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params = jax.device_put({"w": jnp.ones((4, 16))}, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        plan = accum.plan_for(params, None, path="tags", batch_axes=("data",))
    assert "every gradient reduced per microbatch" in plan.summary()


@pytest.mark.parametrize("checks", [1, 2])
def test_cached_trace_still_names_the_parameter(checks):
    """A step already called once (its trace cached), checked once or twice."""
    params = {"w": _put(jnp.ones((4, 16))), "b": _put(jnp.ones((16,)))}

    def drops_b(p, mb):
        h = _dense(p["w"], mb) + jax.reshard(p["b"], P())
        return jnp.sum(jnp.tanh(h)), _weight(mb)

    step = _step(drops_b, None)
    with jax.set_mesh(MESH):
        step(params, BATCH)
        for _ in range(checks):
            with pytest.raises(TagLostError, match=r"^the gradient of \['b'\] \(float32"):
                accum.compile_checked(step, params, BATCH)


def test_zero_d_batch_leaf_is_given_to_every_microbatch():
    batch = {"x": _put(jnp.ones((32, 4)), "data"), "temperature": _put(jnp.float32(2.0))}
    params = {"w": _put(jnp.ones((4, 16)))}

    def loss_fn(p, mb):
        return jnp.sum(_dense(p["w"], mb)) / mb["temperature"], _weight(mb)

    with jax.set_mesh(MESH):
        loss, _, _ = jax.jit(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=4)
        )(params, batch)
    np.testing.assert_allclose(float(loss), 4 * 16 / 2.0, rtol=1e-6)


def test_batch_size_not_divisible_names_both_numbers():
    with pytest.raises(ValueError, match="batch size 32 is not divisible by num_microbatches 3"):
        accum.split_microbatches(BATCH, 3)


def test_integer_parameter_leaves_are_left_untouched():
    params = {"w": _put(jnp.ones((4, 16))), "step": _put(jnp.int32(7))}

    def loss_fn(p, mb):
        return jnp.sum(_dense(p["w"], mb)) * p["step"].astype(jnp.float32), _weight(mb)

    with jax.set_mesh(MESH):
        _, _, grads = jax.jit(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2)
        )(params, BATCH)
    assert grads["step"].dtype == jnp.int32 and int(grads["step"]) == 0
    np.testing.assert_allclose(grads["w"], np.full((4, 16), 7.0), rtol=1e-6)


# (c): a per-use parameter and a deferring one of the same shape. `s` is sharded
# over data (its gradient is reduced per use: the gather's transpose), `b` is
# replicated and defers data; both are f32[16]. A dropped tag on `b` must not
# pass as `s`'s reduction.
SAME_SHAPE = {
    "w": _put(jnp.ones((4, 16))),
    "b": _put(jnp.full((16,), 0.5)),
    "s": _put(jnp.ones((16,)), "data"),
}


def _biased(p, mb, b):
    h = jnp.tanh(_dense(p["w"], mb) + b)
    return jnp.sum(h * jax.reshard(p["s"], P())), _weight(mb)


def drops_b(p, mb):  # b resharded onto P(): its tag dropped, all-reduced per microbatch
    return _biased(p, mb, jax.reshard(p["b"], P()))


def keeps_b(p, mb):
    return _biased(p, mb, pspec_tags.broadcast_param(p["b"], _dense(p["w"], mb)))


def test_a_dropped_tag_on_a_weight_shaped_like_a_per_use_parameter_raises():
    """The verdict follows each reduced array to the accumulator it is added
    into (its parameter), not its shape: b's in-loop all-reduce raises, naming
    b, though s's per-use reduction has the same f32[16]."""
    _per_parameter_verdicts(
        SAME_SHAPE, drops_b, keeps_b, r"^the gradient of \['b'\] \(float32\[[^\n]*$"
    )
