"""A tag dropped inside the model: the compiled verdict raises naming the parameter;
inside a user's own jit the trace-time analysis only warns."""

import warnings

import jax
import pytest

import accum
import hlo_tools as ht
from pspec_tags import TagLostError


def _trace(setup, loss_fn, **kw):
    def fn(params, batch):
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=2, **kw)

    with jax.set_mesh(setup.mesh):
        return jax.jit(fn).trace(setup.params, setup.batch)


def _compile(setup, loss_fn, **kw):
    def fn(params, batch):
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=2, **kw)

    with jax.set_mesh(setup.mesh):
        return accum.compile_checked(fn, setup.params, setup.batch, **kw)


def _dropping(toy, setup, name):
    return toy.Model(setup.mesh, setup.rules, "explicit", drop=name).loss_fn


@pytest.mark.parametrize(("mesh", "name"), [("data8", "w1"), ("data4_fsdp2", "head")])
def test_dropped_tag_raises_naming_the_parameter(toy, get_setup, mesh, name):
    setup = get_setup(mesh)
    with pytest.raises(TagLostError) as info:
        _compile(setup, _dropping(toy, setup, name))
    message, report = str(info.value), info.value.report
    path = "['layers']['w1']" if name == "w1" else "['head']"
    assert "\n" not in message and message.startswith(f"the gradient of {path} ("), message
    blamed = [line for line in report.splitlines() if "gradient of:" in line]
    assert blamed and all(path in line for line in blamed), report  # no other parameter
    assert "toy_model.py:" in message  # the model's source line XLA kept


def test_warn_option_warns_and_compiles(toy, get_setup):
    setup = get_setup("data8")
    with pytest.warns(RuntimeWarning, match=r"\['layers'\]\['w1'\]"):
        compiled = _compile(setup, _dropping(toy, setup, "w1"), on_tag_lost="warn")
    # The silent cost the guard exists for: w1's all-reduce is back in the loop.
    with pytest.raises(AssertionError, match="inside a loop"):
        ht.assert_reduced_once_per_step(compiled.as_text())


def test_trace_time_analysis_warns_and_never_raises_in_a_users_jit(toy, get_setup):
    """Without a compiled program the analysis can only suspect: a warning."""
    setup = get_setup("data8")
    with pytest.warns(RuntimeWarning, match=r"compile_checked[\s\S]*\['layers'\]\['w1'\]"):
        _trace(setup, _dropping(toy, setup, "w1"))


def test_intact_model_passes_the_guard(get_setup):
    setup = get_setup("data8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile(setup, setup.model.loss_fn, on_tag_lost="warn")


def test_find_dropped_tags_direct(toy, get_setup):
    setup = get_setup("data8")
    with jax.set_mesh(setup.mesh):

        @jax.jit
        def probe(params, batch):
            params = accum.tag_reduced(params, ("data",))
            found = accum.find_dropped_tags(
                _dropping(toy, setup, "router"), params, batch, axes=("data",)
            )
            assert list(found) == ["['layers']['router']"], found
            sites = found["['layers']['router']"]
            # The backward reduction first, then the forward reshard that dropped the tag.
            assert "reduces ['data']" in sites[0]
            assert any("tag dropped by reshard" in site for site in sites)
            return 0

        probe.trace(setup.params, setup.batch)  # traced only: nothing runs


def test_unknown_option_is_rejected(get_setup):
    setup = get_setup("data8")
    with pytest.raises(ValueError, match="on_tag_lost"):
        _trace(setup, setup.model.loss_fn, on_tag_lost="loud")


def test_fused_layer_type_check_explains_and_never_raises(get_setup):
    """The fused path's per-layer type check is trace-time analysis too: a layer
    gradient not typed unreduced over its deferred axes (autodiff does not make
    one for a reduced parameter, so it is built here by hand) is a suspect named
    in compile_checked's message, or a warning in a user's own jit, never a
    TagLostError before anything compiles (the compiled verdict decides)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from accum.fused_accumulate import _prepare
    from accum.plan import PER_STEP, LeafPlan
    from accum.verdict import recording

    mesh = get_setup("data8").mesh
    leaf = LeafPlan(when=(("data", PER_STEP),), param_spec=P(), accumulator_spec=P())
    plain = jax.device_put(jax.numpy.zeros(4), NamedSharding(mesh, P()))  # not unreduced
    with pytest.warns(RuntimeWarning, match=r"\['w'\][\s\S]*not typed unreduced"):
        _prepare(leaf, "explicit", None, "['w']", on_tag_lost="raise")(plain)
    with warnings.catch_warnings(), recording() as record:
        warnings.simplefilter("error")
        _prepare(leaf, "explicit", None, "['w']", on_tag_lost="raise")(plain)
        _prepare(leaf, "explicit", None, "['w']", on_tag_lost="ignore")(plain)
    assert list(record.suspects) == ["['w']"]
