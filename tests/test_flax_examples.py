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
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

pytest.importorskip("flax")
sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "flax"))
common = importlib.import_module("common")

EXAMPLES = [
    "nnx_mlp",
    "linen_transformer",
    "cnn_l2",
    "scan_frozen",
    "bf16_master",
    "nnx_scan_remat",
    "masked_smoothed",
]
MESHES = {
    "explicit_data8": ("explicit", 1),
    "auto_data4_model2": ("auto", 2),
    "auto_data8": ("auto", 1),
    # Explicit data x model: the batch over data only, the model axis left to the model.
    "explicit_data4_model2": ("explicit", 2),
}
CASES = [(name, mesh) for name in EXAMPLES for mesh in ("explicit_data8", "auto_data4_model2")]
CASES += [("nnx_mlp", "explicit_data4_model2"), ("linen_transformer", "explicit_data4_model2")]


def _no_in_loop_reduction(text, allowed=()):
    """No gradient-sized reduction inside a loop (but of the `allowed` types: the
    model's own); some reduction after it."""
    module = hlo_tools.parse(text)
    reductions = [c for c in hlo_tools.collectives(module) if c.kind in hlo_tools.REDUCTION_KINDS]
    big = [c.type_str for c in reductions if c.loops and max(a.elements for a in c.arrays) > 8]
    assert not [t for t in big if t not in allowed], big
    assert any(not c.loops for c in reductions)


@pytest.mark.parametrize(("name", "mesh_name"), CASES)
def test_example_full_batch_gradients_and_no_in_loop_reduction(name, mesh_name):
    mesh = common.make_mesh(*MESHES[mesh_name])
    example = importlib.import_module(name)
    loss_fn, params, batch = example.setup(mesh)
    # bf16_master: bf16 compute, sums kept in f32, compared at bf16's precision.
    accum_dtype = getattr(example, "ACCUM_DTYPE", None)
    rtol, atol = getattr(example, "RTOL", 2e-4), getattr(example, "ATOL", 1e-6)

    def step(p, b):
        return accum.accumulate_gradients(
            loss_fn, p, b, num_microbatches=2, accum_dtype=accum_dtype
        )

    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, params, batch)
        _, aux, grads = compiled(params, batch)
    if accum_dtype is not None:
        assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(accum_dtype)}

    def full(p, b):
        loss_sum, full_aux = loss_fn(p, b)
        return loss_sum / full_aux["weight"]

    # The reference: one jax.grad over the whole batch on one device, no mesh.
    ref = jax.jit(jax.grad(full))(*jax.device_get((params, batch)))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    _no_in_loop_reduction(compiled.as_text())


def _device_microbatch_groups(rows, devices=8, n=2):
    """The rows each (device, microbatch) sees on the local path: device d's
    block of rows, microbatch i its rows i, i+n, ... (accum.local)."""
    block = rows // devices
    return [np.arange(d * block + i, (d + 1) * block, n) for d in range(devices) for i in range(n)]


def _each_group(fn, params, groups):
    """`fn(params, group)` for each group, through one jit: the groups share their
    shapes, so one compile serves all (run op by op, the 16 MoE gradients took 20 s)."""
    compiled = jax.jit(fn)
    return [compiled(params, g) for g in groups]


def _grad_of_loss(loss_fn):
    return jax.grad(lambda p, b: loss_fn(p, b)[0])


@pytest.mark.parametrize("mesh_name", ["explicit_data8", "auto_data4_model2"])
def test_batchnorm_statistics_per_device_rows_and_running_averages(mesh_name):
    """Stock linen BatchNorm through a TrainState, loss_fn closing over its
    batch_stats: gradients and new running averages are those of DDP
    (statistics over each device's rows of each microbatch, averaged)."""
    mesh = common.make_mesh(*MESHES[mesh_name])
    example = importlib.import_module("batchnorm")
    state, batch = example.setup(mesh)
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(example.train_step, state, batch)
        new, _, grads = compiled(state, batch)
    state, batch = jax.device_get((state, batch))
    loss_fn = example.make_loss(state.apply_fn, state.batch_stats)
    # The batch devices: those of "data", the axis the batch is placed over (on
    # the auto mesh too: compile_checked reads the placed batch's shardings).
    devices = mesh.shape["data"]
    groups = _device_microbatch_groups(64, devices=devices)
    groups = [jax.tree.map(lambda x, g=g: x[g], batch) for g in groups]
    per_group = _each_group(_grad_of_loss(loss_fn), state.params, groups)
    ref = jax.tree.map(lambda *g: sum(g) / 64, *per_group)
    stats = _each_group(lambda p, b: loss_fn(p, b)[1]["batch_stats"], state.params, groups)
    ref_stats = jax.tree.map(lambda *s: sum(s) / 64, *stats)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(new.batch_stats), jax.tree.leaves(ref_stats), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The statistics moved (momentum 0.9 from zeros): the aux carried them.
    old_mean = state.batch_stats["BatchNorm_0"]["mean"]
    assert not np.allclose(new.batch_stats["BatchNorm_0"]["mean"], old_mean)
    _no_in_loop_reduction(compiled.as_text())


@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize("mesh_name", ["explicit_data8", "auto_data8"])
def test_sync_batchnorm_statistics_over_the_whole_microbatch(kind, mesh_name):
    """Stock BatchNorm with axis_name='data' (linen and nnx): statistics over every
    device's rows of each microbatch, so gradients and running averages equal one
    device running the microbatches in turn (the documented semantics). In the loop
    only the layer's own reduction of its statistics (mean and mean square of 16
    features, forward and backward); no gradient's."""
    example = importlib.import_module("sync_batchnorm")
    mesh = common.make_mesh(*MESHES[mesh_name])
    (grads, stats), compiled = example.run_on(mesh, kind)
    want_grads, want_stats = example.reference(kind, example.batch_of())
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(stats), jax.tree.leaves(want_stats), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    _no_in_loop_reduction(compiled.as_text(), allowed=("f32[2,16]", "(f32[1,16], f32[1,16])"))


def test_nnx_tensor_parallel_on_an_explicit_data_model_mesh():
    """Stock nnx layers, column then row parallel over 'model', on data=4 x model=2:
    the batch axes are the batch's ('data', never 'model'), the gradients are the
    full batch's and stay sharded over 'model', no gradient reduction in the loop,
    and the step compile_checked returns runs step after step unpinned."""
    example = importlib.import_module("nnx_tensor_parallel")
    mesh = common.make_mesh(*MESHES["explicit_data4_model2"])
    loss_fn, params, batch = example.setup(mesh)
    with jax.set_mesh(mesh):
        plan = accum.choose_path(
            loss_fn, params, batch, num_microbatches=2, plan=accum.plan_for(params, batch)
        )
        assert plan.batch_axes == ("data",)
        compiled = accum.compile_checked(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2),
            params,
            batch,
        )
        _, _, grads = compiled(params, batch)
        replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
        full_batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P()))
        ref = jax.jit(jax.grad(lambda p: loss_fn(p, full_batch)[0] / 32))(replicated)
        _, losses = common.train(loss_fn, params, batch, common.optax.adamw(1e-2), steps=4)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
    assert any("model" in str(g.sharding.spec) for g in jax.tree.leaves(grads))
    assert losses[-1] < losses[0]
    # In the loop only the row-parallel layer's own reduction over "model" of its
    # output (4 rows per device x 3 classes: activations, tensor parallelism's cost).
    assert not accum.in_loop_reductions(compiled.as_text())
    _no_in_loop_reduction(compiled.as_text(), allowed=("f32[4,3]",))


def test_moe_balance_loss_per_device_microbatch_group():
    """A top-2 MoE's balance loss, computed across the rows loss_fn sees, gets on
    the local path one group per device and microbatch (the documented
    semantics): the gradient equals the rows-weighted sum over those groups."""
    mesh = common.make_mesh("explicit")
    example = importlib.import_module("moe_balance")
    loss_fn, params, batch = example.setup(mesh)
    with jax.set_mesh(mesh):
        plan = accum.choose_path(
            loss_fn, params, batch, num_microbatches=2, plan=accum.plan_for(params, batch)
        )
        compiled = accum.compile_checked(
            lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=2),
            params,
            batch,
        )
        _, _, grads = compiled(params, batch)
    assert plan.path == "local"
    params, batch = jax.device_get((params, batch))
    groups = [jax.tree.map(lambda x, g=g: x[g], batch) for g in _device_microbatch_groups(64)]
    per_group = _each_group(_grad_of_loss(loss_fn), params, groups)
    ref = jax.tree.map(lambda *g: sum(g) / 64, *per_group)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    # Not the microbatch's balance: the router's gradient differs from that reference.
    whole = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
    per_mb = _each_group(_grad_of_loss(loss_fn), params, whole)
    router = sum(g["router"]["kernel"] for g in per_mb) / 64
    assert not np.allclose(np.asarray(grads["router"]["kernel"]), router, rtol=1e-4, atol=1e-7)
    _no_in_loop_reduction(compiled.as_text())


def test_nnx_decoder_lm_equals_the_full_batch_step_and_trains_with_dropout():
    """The nnx decoder LM (tied Embed through attend, causal MultiHeadAttention,
    Dropout, masked tokens): with dropout off, its accum AdamW steps are the plain
    full-batch step's (losses and parameters after 2 steps, f32), no gradient
    reduction in the loop; with dropout on (a fresh key a step) the loss falls."""
    example = importlib.import_module("nnx_decoder_lm")
    mesh = common.make_mesh("explicit")
    (params, losses), (ref, ref_losses), step = example.check_against_full_batch(mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    # AdamW moves each weight by about lr (1e-3) a step: 1e-6 is f32 rounding.
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    _no_in_loop_reduction(step.as_text())
    # The model's own tied embedding moved: attend's gradient reached it.
    start = example.setup(mesh)[1]
    assert not np.allclose(params["embed"]["embedding"], start["embed"]["embedding"])
    trained = example.main(steps=5)
    assert trained[-1] < trained[0], trained
