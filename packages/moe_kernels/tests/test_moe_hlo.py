"""Compiled-HLO placement of the expert-kernel gradient reduction under gradient accumulation.

Mesh data=2 x expert=4 (explicit); tokens sharded over both. Gradient
accumulation (a lax.scan over 4 microbatches, written here) reshards every
parameter to `reduced` over the batch axes it is not partitioned over, so each
microbatch's gradient comes out `unreduced` and is reduced once after the loop.
With the kernels' tags carried into the shard_map there is no reduction in its
body; built untagged (the pre-fix behaviour) shard_map psums the kernel
cotangents inside the body, i.e. inside the accumulation loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hlo_tools import (
    REDUCTION_KINDS,
    assert_reduced_once_per_step,
    collectives,
    cross_replica_all_reduce_sizes,
    parse,
    split_by_entry_loop,
)
from moe_kernels import DEFAULT_RULES, MoEConfig, init_params, param_specs, sparse_moe
from pspec_tags import mesh_axes_used, spec_of, unreduced_axes, with_reduced

MICROBATCHES = 4
BATCH_AXES = frozenset({"data", "expert"})
CFG = MoEConfig(num_experts=8, num_experts_per_tok=2, mlp_dim=16, n_groups=4, topk_groups=2,
                num_shared_experts=1)  # fmt: skip


def _ga_step(specs, mesh, keep_tags, seen):
    def loss(params, x):
        y, stats = sparse_moe(x, params, config=CFG, mesh=mesh, keep_tags=keep_tags)
        return jnp.mean(y * y) + 0.01 * stats["balance_loss"]

    def step(params, xs_MxBxSxD):
        # TAG: what an accumulator does under explicit sharding: each parameter
        # is `reduced` over the batch axes that do not partition it.
        reduced = {
            n: jax.reshard(w, with_reduced(specs[n], BATCH_AXES - set(mesh_axes_used(specs[n]))))
            for n, w in params.items()
        }
        grad = jax.grad(loss)
        first = grad(reduced, xs_MxBxSxD[0])
        seen.update({n: spec_of(g) for n, g in first.items()})

        def microbatch(acc, x):
            return jax.tree.map(jnp.add, acc, grad(reduced, x)), None

        acc, _ = jax.lax.scan(microbatch, first, xs_MxBxSxD[1:])
        # The one reduction per step: unreduced -> plain spec.
        return {n: jax.reshard(g, specs[n]) for n, g in acc.items()}

    return step


@pytest.fixture(scope="module")
def compiled(mesh_factory):
    mesh = mesh_factory(4)
    params = init_params(jax.random.key(0), CFG, 32)
    specs = param_specs(CFG, DEFAULT_RULES, mesh, {n: w.shape for n, w in params.items()})
    x = jax.random.normal(jax.random.key(1), (MICROBATCHES, 8, 4, 32))
    out = {}
    with jax.set_mesh(mesh):
        params = {n: jax.device_put(w, NamedSharding(mesh, specs[n])) for n, w in params.items()}
        x = jax.device_put(x, NamedSharding(mesh, P(None, ("data", "expert"))))
        for keep_tags in (True, False):
            seen = {}
            fn = jax.jit(_ga_step(specs, mesh, keep_tags, seen)).lower(params, x).compile()
            out[keep_tags] = (fn.as_text(), jax.device_get(fn(params, x)), seen)
    return out


def _in_body_reductions(text):
    """Reductions of more than 8 elements that come from inside the shard_map."""
    return [
        c
        for c in collectives(parse(text))
        if c.kind in REDUCTION_KINDS
        and c.cross_replica
        and c.elements > 8
        and "shard_map" in c.op_name
    ]


def test_tagged_kernels_reduce_once_per_step(compiled):
    text, _, seen = compiled[True]
    assert _in_body_reductions(text) == []
    inside, _ = split_by_entry_loop(text)
    assert all(n <= 8 for n in cross_replica_all_reduce_sizes(inside))
    outside = assert_reduced_once_per_step(text)  # also the vacuity guard
    # Every expert kernel's gradient is among those reduced after the loop.
    shapes = {c.shape for c in outside} | {s for c in outside for s in c.shape}
    assert (2, 32, 16) in shapes and (2, 16, 32) in shapes, shapes
    # At trace time the microbatch gradients are unreduced over the batch axes.
    assert unreduced_axes(seen["wi_0"]) == {"data"}
    assert unreduced_axes(seen["gate"]) == BATCH_AXES


def test_untagged_in_specs_psum_in_the_body(compiled):
    text, _, seen = compiled[False]
    in_body = _in_body_reductions(text)
    in_loop = [c for c in in_body if c.in_loop]
    assert in_loop, "untagged in_specs should psum the kernel cotangents inside the loop"
    assert any((2, 32, 16) in ((c.shape,) + tuple(c.shape)) for c in in_loop)
    with pytest.raises(AssertionError, match="inside a loop"):
        assert_reduced_once_per_step(text)
    # Invisible at trace time: the reshard's transpose re-tags the cotangent
    # `unreduced` after the psum already ran, so only the HLO shows the bug.
    assert unreduced_axes(seen["wi_0"]) == {"data"}


def test_tagged_and_untagged_gradients_agree(compiled):
    tagged, untagged = compiled[True][1], compiled[False][1]
    for name in tagged:
        scale = float(np.max(np.abs(untagged[name]))) or 1.0
        np.testing.assert_allclose(tagged[name], untagged[name], rtol=1e-5, atol=1e-5 * scale)


LAYERS = 3


@pytest.fixture(scope="module")
def scanned_over_layers(mesh_factory):
    """The trainer's shape: layer params stacked on a leading dim, lax.scan over layers."""
    mesh = mesh_factory(4)
    keys = jax.random.split(jax.random.key(0), LAYERS)
    params = jax.vmap(lambda k: init_params(k, CFG, 32))(keys)
    specs = param_specs(CFG, DEFAULT_RULES, mesh, {n: w.shape[1:] for n, w in params.items()})
    stacked = {n: P(None, *s.partitions) for n, s in specs.items()}
    texts = {}
    with jax.set_mesh(mesh):
        params = {n: jax.device_put(w, NamedSharding(mesh, stacked[n])) for n, w in params.items()}
        x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 4, 32)), P(("data", "expert")))
        for keep_tags in (True, False):

            def loss(p, x, keep_tags=keep_tags):
                red = {
                    n: jax.reshard(
                        w, with_reduced(stacked[n], BATCH_AXES - set(mesh_axes_used(stacked[n])))
                    )
                    for n, w in p.items()
                }

                def layer(h, layer_params):
                    # Each slice keeps the stacked value's reduced tag.
                    y, _ = sparse_moe(h, layer_params, config=CFG, mesh=mesh, keep_tags=keep_tags)
                    return h + y, None

                h, _ = jax.lax.scan(layer, x, red)
                return jnp.mean(h * h)

            texts[keep_tags] = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    return texts


def test_scan_over_layers_tagged_has_no_per_layer_reduction(scanned_over_layers):
    assert_reduced_once_per_step(scanned_over_layers[True])


def test_scan_over_layers_untagged_reduces_per_layer(scanned_over_layers):
    with pytest.raises(AssertionError, match=rf"x{LAYERS}/step"):
        assert_reduced_once_per_step(scanned_over_layers[False])
