"""examples/flax: stock Flax/optax programs through accum, unchanged (issue #44).

Each example's loss_fn, through `accumulate_gradients` compiled by
`compile_checked`, gives the full batch's gradients, and its compiled program
has no gradient reduction inside the microbatch loop (hlo_tools), on explicit
and auto meshes."""

import importlib
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import accum
import hlo_tools

pytest.importorskip("flax")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "flax"))
common = importlib.import_module("common")

EXAMPLES = ["nnx_mlp", "linen_transformer", "cnn_l2", "scan_frozen"]
MESHES = {"explicit_data8": ("explicit", 1), "auto_data4_model2": ("auto", 2)}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_full_batch_gradients_and_no_in_loop_reduction(name, mesh_name):
    mesh = common.make_mesh(*MESHES[mesh_name])
    loss_fn, params, batch = importlib.import_module(name).setup(mesh)

    def step(p, b):
        return accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2)

    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, params, batch)
        _, aux, grads = compiled(params, batch)

    def full(p, b):
        loss_sum, full_aux = loss_fn(p, b)
        return loss_sum / full_aux["weight"]

    # The reference: one jax.grad over the whole batch on one device, no mesh.
    ref = jax.jit(jax.grad(full))(*jax.device_get((params, batch)))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    text = compiled.as_text()
    in_loop = [c for c in hlo_tools.collectives(hlo_tools.parse(text)) if c.loops]
    big = [
        c
        for c in in_loop
        if c.kind in hlo_tools.REDUCTION_KINDS and max(a.elements for a in c.arrays) > 8
    ]
    assert not big, [c.type_str for c in big]
    assert any(
        c.kind in hlo_tools.REDUCTION_KINDS and not c.loops
        for c in hlo_tools.collectives(hlo_tools.parse(text))
    )
