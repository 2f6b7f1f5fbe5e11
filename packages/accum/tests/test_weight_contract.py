"""aux['weight'] that counts nothing (`{"weight": 1}` beside a mean) warns once per
trace of the step, from accum.contract_probe's traces before the loop (docs/accum.md,
"The loss contract"); a weight that counts (a mask's sum, the rows) does not. The
check costs at most the probe's one trace on twice the rows: it was a trace on half
the rows per call of `loss_fn` in the loop (accum.contract.check_weight, removed)."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum

ROWS, N = 32, 2
MB = ROWS // N  # the microbatch's rows
# The plans: the path forced, or the default plan (choose_path traces one
# microbatch to pick a path: tags here).
PATHS = ["tags", "local", "default"]
# The rows the loop's traces of loss_fn see: the microbatch's, one device's (of 8).
LOOP_ROWS = {"tags": MB, "local": MB // 8, "default": MB}
# Traces of loss_fn per step trace before the weight check moved into the probe
# (the in-loop check traced half the rows at each call), measured on 03d741c with
# `_lower`'s counter; now 4 (5 with the default plan) for each.
BEFORE = {("tags", "mean_int"): 6, ("local", "mean_int"): 6, ("default", "mean_int"): 8}
BEFORE |= {("tags", "python_int_rows"): 5, ("local", "python_int_rows"): 5}
BEFORE |= {("default", "python_int_rows"): 7}
WARNED = r"aux\['weight'\] is 1 for a microbatch's 16 rows and for twice as many"


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _sq(p, mb):
    return jnp.sum((mb["x"] @ p["w"] - mb["y"]) ** 2)


# Weights fixed at trace time that count nothing: each warns.
NOTHING = {
    "mean_int": lambda p, mb: (_sq(p, mb) / mb["x"].shape[0], {"weight": 1}),
    "mean_f32": lambda p, mb: (_sq(p, mb) / mb["x"].shape[0], {"weight": jnp.float32(1.0)}),
    "sum_int": lambda p, mb: (_sq(p, mb), {"weight": 1}),
}
# Weights that count the targets (or a zero weight, counting none on purpose): silent.
COUNTS = {
    "mask_sum": lambda p, mb: (
        jnp.sum(mb["m"] * (mb["x"] @ p["w"] - mb["y"]) ** 2),
        {"weight": jnp.sum(mb["m"])},
    ),
    "f32_rows": lambda p, mb: (_sq(p, mb), {"weight": jnp.float32(mb["x"].shape[0])}),
    "python_int_rows": lambda p, mb: (_sq(p, mb), {"weight": mb["x"].shape[0]}),
    "python_float_4_per_row": lambda p, mb: (_sq(p, mb), {"weight": mb["x"].shape[0] * 4.0}),
    "zero": lambda p, mb: (_sq(p, mb), {"weight": 0}),
}


def _inputs(mesh):
    x = jax.random.normal(jax.random.key(0), (ROWS, 4))
    y = jax.random.normal(jax.random.key(1), (ROWS,))
    m = (jnp.arange(ROWS) % 3 != 0).astype(jnp.float32)
    return (
        jax.device_put({"w": jnp.ones(4)}, NamedSharding(mesh, P())),
        jax.device_put({"x": x, "y": y, "m": m}, NamedSharding(mesh, P("data"))),
    )


def _lower(mesh, loss_fn, path):
    """Trace and lower one step (no compile) on `path`; the weight warnings given,
    and the rows of each trace of `loss_fn`."""
    seen = []

    def counted(p, mb):
        seen.append(mb["x"].shape[0])  # a Python side effect: runs once per trace
        return loss_fn(p, mb)

    def step(p, b):
        plan = None if path == "default" else accum.plan_for(p, b, path=path)
        return accum.accumulate_gradients(counted, p, b, num_microbatches=N, plan=plan)

    params, batch = _inputs(mesh)
    with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
        warnings.simplefilter("always")  # every warning given, not once per location
        jax.jit(step).lower(params, batch)
    said = [str(w.message) for w in caught if "aux['weight'] is " in str(w.message)]
    return said, seen


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(NOTHING))
def test_a_weight_that_counts_nothing_warns_once(mesh, name, path):
    said, _ = _lower(mesh, NOTHING[name], path)
    assert len(said) == 1, said  # once per step trace, not once per microbatch or trace
    assert re.match(f"accum: {WARNED}", said[0]), said
    assert "aux['weight'] = the number of targets" in said[0] and "\n" not in said[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(COUNTS))
def test_a_weight_that_counts_is_silent(mesh, name, path):
    said, _ = _lower(mesh, COUNTS[name], path)
    assert said == []


@pytest.mark.parametrize("path", PATHS)
def test_the_weight_check_costs_at_most_the_probes_doubled_trace(mesh, path):
    """Only the probe's rows (the microbatch's, twice as many once) and the loop's:
    no trace on half of either (the old in-loop check's), fewer traces than before."""
    allowed = {MB, 2 * MB, LOOP_ROWS[path]}
    for name in ("mean_int", "python_int_rows"):
        _, seen = _lower(mesh, NOTHING.get(name) or COUNTS[name], path)
        assert set(seen) <= allowed and seen.count(2 * MB) == 1, (name, seen)
        assert len(seen) < BEFORE[path, name], (name, seen)
    # A weight that is not a constant, and an array constant beside a sum (the common
    # idiom): nothing to compare, no second trace.
    for name in ("mask_sum", "f32_rows"):
        _, seen = _lower(mesh, COUNTS[name], path)
        assert set(seen) <= allowed - {2 * MB}, (name, seen)


def test_start_warns_as_accumulate_gradients_does(mesh):
    params, batch = _inputs(mesh)
    microbatch = jax.tree.map(lambda x: x[::N], jax.device_get(batch))
    with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
        warnings.simplefilter("always")
        microbatch = jax.device_put(microbatch, NamedSharding(mesh, P("data")))
        jax.jit(accum.start, static_argnums=0).lower(NOTHING["mean_int"], params, microbatch)
    said = [str(w.message) for w in caught if "aux['weight'] is " in str(w.message)]
    assert len(said) == 1 and re.match(f"accum: {WARNED}", said[0]), said
