"""TPU AOT (v5e:2x4, compiled on this CPU host): the HLO assertions on a real backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import accum
import hlo_tools as ht

pytestmark = pytest.mark.aot
N = 4
BATCH = 96


@pytest.fixture(scope="module")
def tpu(toy):
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("v5e:2x4", "tpu")
    mesh = toy.make_mesh("data8", devices=topo.devices)
    rules = toy.rules_for("data8")
    specs = toy.param_specs(mesh, rules)

    def abstract(tree, specs):
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            tree,
            specs,
        )

    params = abstract(toy.init_params(0), specs)
    batch = abstract(toy.make_batch(1, BATCH), toy.batch_specs(mesh, rules))
    return mesh, toy.Model(mesh, rules), params, batch


def _compile(tpu, defer):
    mesh, model, params, batch = tpu

    def fn(p, b):
        plan = accum.plan_for(p, b, policy="deferred" if defer else "per_microbatch")
        return accum.accumulate_gradients(model.loss_fn, p, b, num_microbatches=N, plan=plan)

    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(params, batch).compile().as_text()


def test_tpu_deferred_reduces_once_per_step(tpu):
    outside = ht.assert_reduced_once_per_step(_compile(tpu, True), max_in_loop_elements=8)
    params = tpu[2]
    assert sum(c.elements for c in outside) >= sum(
        int(np.prod(p.shape)) for p in jax.tree.leaves(params)
    )


def test_tpu_per_microbatch_reduction_is_caught(tpu):
    with pytest.raises(AssertionError, match="inside a loop"):
        ht.assert_reduced_once_per_step(_compile(tpu, False), max_in_loop_elements=8)


@pytest.mark.parametrize("compute_dtype", [None, jnp.bfloat16])
def test_tpu_zero1_reduces_outside_the_loop_into_shards(tpu, compute_dtype):
    optax = pytest.importorskip("optax")
    mesh, model, params, batch = tpu
    optimizer = optax.adam(1e-2)
    shardings = accum.zero1_shardings(params, mesh)
    master = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings
    )
    specs = jax.tree.map(lambda p: p.sharding.spec, params)

    def step(master, opt_state, batch):
        return accum.zero1_step(
            model.loss_fn,
            optimizer,
            master,
            opt_state,
            batch,
            num_microbatches=N,
            compute_shardings=specs,
            compute_dtype=compute_dtype,
        )

    with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(optimizer.init, master)
        compiled = jax.jit(step).lower(master, opt_state, batch).compile()
    ht.assert_reduced_once_per_step(compiled.as_text(), max_in_loop_elements=8)
    # New masters come out in the ZeRO-1 layout. (At these sizes the TPU
    # compiler keeps all-reduce + dynamic-slice; on large gradients it fuses
    # them into an all-reduce-scatter.)
    new_master = compiled.output_shardings[0]
    for out, want in zip(jax.tree.leaves(new_master), jax.tree.leaves(shardings), strict=True):
        assert out.spec == want.spec
    gathers = [c for c in ht.collectives(compiled.as_text()) if c.kind == "all-gather"]
    assert gathers and not any(c.in_loop for c in gathers)
    if compute_dtype is not None:  # cast before the gather: it moves bf16
        assert {c.dtype for c in gathers} == {"bf16"}
