"""The compiled verdict on a reduction XLA combined from several: judged array by array.

A weight sharded over 'data' at rest (ZeRO-3 over the only batch axis) has its
gradient reduced over 'data' per use, by design (the per-parameter plan), and a
Gram matrix over the batch is a forward all-reduce over 'data' (the model's own
communication). Alone, neither is a finding; XLA's all-reduce combiner merges
the two into one tuple all-reduce in the loop, whose joined op_name names a
backward op. Judged whole, that collective was blamed on the Gram weight and
raised TagLostError on a correct model (guard_generator seed 434); judged per
array, the forward one is the model's and the backward one is the plan's. A
norm weight whose tag is dropped (resharded onto P()) is still found when its
reduction joins the same combined all-reduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools
import pspec_tags as pt
from accum.verdict import array_op_names, in_backward

DIM, ROWS = 16, 32


def _loss_fn(p, mb, drop=False):
    x = mb["x"]
    # TAG: the per-use rule: reduced over the gathered token axis, so the
    # transpose reduces 'data' for w alone, per use.
    tag = accum.reduced_at_use(pt.spec_of(p["w"]), P(None, None), ("data",))
    w = jax.reshard(p["w"], pt.with_reduced(P(None, None), tag))
    h = jnp.tanh(jnp.einsum("bd,de->be", x, w, out_sharding=P("data", None)))
    # TAG: kept (broadcast_param), or dropped: a spec rebuilt from rules, so v's
    # gradient (a sum over the rows) is all-reduced over 'data' every microbatch.
    h = h * (jax.reshard(p["v"], P()) if drop else pt.broadcast_param(p["v"], h))
    # A sum over the batch rows: a forward all-reduce over 'data' in the loop.
    gram = jnp.einsum("bd,be->de", h, h, out_sharding=P())
    penalty = jnp.sum(gram * pt.broadcast_param(p["g"], gram)) * 1e-2
    return jnp.sum(h) + jax.reshard(penalty, P()), {"weight": jnp.float32(x.shape[0])}


def _compile(drop: bool):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)

    def put(shape, spec):
        value = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        return jax.device_put(value, NamedSharding(mesh, spec))

    with jax.set_mesh(mesh):
        params = {
            "w": put((DIM, DIM), P("data", None)),
            "g": put((DIM, DIM), P()),
            "v": put((DIM,), P()),
        }
        batch = {"x": put((ROWS, DIM), P("data", None))}
        plan = accum.plan_for(params, batch, per_parameter=True)

        def step(p, b):
            loss_fn = functools.partial(_loss_fn, drop=drop)
            # The dropped tag's trace-time warning is not what is tested here.
            quiet = {"on_tag_lost": "ignore"} if drop else {}
            return accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2, plan=plan, **quiet)

        # The default on_tag_lost="raise" (a false alarm fails here); the
        # dropped tag's program is compiled unchecked and checked by the test.
        if drop:
            return jax.jit(step).lower(params, batch).compile()
        return accum.compile_checked(step, params, batch)


@pytest.fixture(scope="module")
def compiled():
    return _compile(drop=False)


def test_the_combined_reduction_is_there(compiled):
    """The premise: one all-reduce over 'data' in the loop carries both arrays."""
    module = hlo_tools.parse(compiled.as_text())
    combined = [
        c
        for c in hlo_tools.collectives(module)
        if c.kind == "all-reduce" and c.loops and sum(a.elements > 8 for a in c.arrays) >= 2
    ]
    assert combined, [(c.name, c.arrays, c.op_name) for c in hlo_tools.collectives(module)]
    names = [array_op_names(module, c) for c in combined]
    assert any(
        any(in_backward(n) for n in per) and not all(in_backward(n) for n in per) for per in names
    ), names


def test_a_forward_psum_combined_with_a_by_design_reduction_is_no_finding(compiled):
    assert accum.check_compiled(compiled.as_text()) == []


def test_a_dropped_tag_in_the_combined_reduction_is_still_found():
    text = _compile(drop=True).as_text()
    with pytest.raises(pt.TagLostError, match=r"\['v'\]") as caught:
        accum.check_compiled(text)
    assert "'g'" not in str(caught.value)
