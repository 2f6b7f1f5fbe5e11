"""Fused accumulation (gradients added inside the backward layer scan) and the overlapped
last-microbatch reduction: same numbers as the plain path, reductions where they belong."""

import warnings
from functools import partial

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools as ht
from accum.overlapped import OVERLAPPED_SCOPE
from pspec_tags import spec_of, unreduced_axes

N = 4
FLOATS = ("f32", "bf16")
CASES = [
    (mesh, how)
    for mesh in ("data8", "data4_fsdp2", "data2_expert4")
    for how in ("fused", "overlapped")
]


def _compiled(setup, how, n=N):
    def build():
        def fn(params, batch):
            return accum.accumulate_gradients(
                setup.model.loss_fn, params, batch, num_microbatches=n, schedule=how
            )

        return jax.jit(fn).lower(setup.params, setup.batch).compile()

    return setup.cached(("accumulate", how, n), build)


def _plain(setup, n=N):
    def build():
        def fn(params, batch):
            return accum.accumulate_gradients(
                setup.model.loss_fn, params, batch, num_microbatches=n
            )

        return jax.jit(fn).lower(setup.params, setup.batch).compile()

    # test_accumulate's key for the same (default, deferred) plan: one compile.
    return setup.cached(("accumulate", n, "deferred"), build)


@pytest.mark.parametrize(("mesh", "how"), CASES)
def test_same_numbers_as_full_batch(get_setup, close, mesh, how):
    setup = get_setup(mesh)
    (ref_loss, ref_aux), ref_grads = setup.reference()
    loss, aux, grads = _compiled(setup, how)(setup.params, setup.batch)
    close(loss, ref_loss, rtol=1e-5)
    close(aux, ref_aux, rtol=1e-5)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(setup.params), strict=True):
        assert not unreduced_axes(spec_of(g))
        assert spec_of(g).partitions == spec_of(p).partitions


@pytest.mark.parametrize("how", ["fused", "overlapped"])
def test_auto_mode_same_numbers(get_setup, close, how):
    setup = get_setup("data8", "auto")
    (ref_loss, _), ref_grads = setup.reference()
    loss, _, grads = _compiled(setup, how, n=3)(setup.params, setup.batch)
    close(loss, ref_loss, rtol=1e-5)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_one_microbatch_is_the_plain_path(get_setup):
    """Nothing to accumulate: schedule="fused" with one microbatch lowers to the plain
    path's program (no zero accumulator added into the backward pass)."""
    setup = get_setup("data8")

    def lowered(n, **kw):
        def fn(params, batch):
            return accum.accumulate_gradients(
                setup.model.loss_fn, params, batch, num_microbatches=n, **kw
            )

        with jax.set_mesh(setup.mesh):
            return jax.jit(fn).lower(setup.params, setup.batch).as_text()

    assert lowered(1, schedule="fused") == lowered(1)
    # Two microbatches do fuse (the comparison above could not pass vacuously).
    assert lowered(2, schedule="fused") != lowered(2)


def test_per_microbatch_plan_is_the_plain_path(get_setup):
    """A per-microbatch plan keeps no partial sums: schedule="fused" lowers to the plain
    path's program (fusing let XLA:TPU move the per-layer reductions out of the
    backward scan onto a full-size gradient), through accumulate_gradients and add."""
    setup = get_setup("data8")
    loss_fn = setup.model.loss_fn

    def lowered(fn, *args):
        with jax.set_mesh(setup.mesh):
            return jax.jit(fn).lower(*args).as_text()

    def scan(policy, **kw):
        return lowered(
            lambda p, b: accum.accumulate_gradients(
                loss_fn, p, b, num_microbatches=2, plan=accum.plan_for(p, b, policy=policy), **kw
            ),
            setup.params,
            setup.batch,
        )

    assert scan("per_microbatch", schedule="fused") == scan("per_microbatch")
    # A deferred plan does fuse (the comparison above could not pass vacuously).
    assert scan("deferred", schedule="fused") != scan("deferred")

    # One microbatch of two, placed like the batch (the strided split).
    microbatch = jax.tree.map(lambda x: jax.device_put(np.asarray(x)[::2], x.sharding), setup.batch)

    def add(policy, **kw):
        with jax.set_mesh(setup.mesh):
            acc = jax.jit(
                lambda p, b: accum.start(loss_fn, p, b, plan=accum.plan_for(p, b, policy=policy))
            )(setup.params, microbatch)
        assert acc.plan.fused_applies == (policy == "deferred")
        step = lambda a, p, b: accum.add(a, loss_fn, p, b, **kw)  # noqa: E731
        return lowered(step, acc, setup.params, microbatch)

    assert add("per_microbatch", schedule="fused") == add("per_microbatch")
    assert add("deferred", schedule="fused") != add("deferred")


def test_fused_loop_holds_no_reduction_and_bytes_match(get_setup):
    setup = get_setup("data8")
    fused = _compiled(setup, "fused").as_text()
    plain = _plain(setup).as_text()
    ht.assert_reduced_once_per_step(fused)
    assert _reduction_bytes(fused) == _reduction_bytes(plain)


def test_overlap_reduces_each_layer_once_after_the_loop(get_setup):
    setup = get_setup("data8")
    module = ht.parse(_compiled(setup, "overlapped").as_text())
    # Nothing in the loop over the first N-1 microbatches (a per-microbatch
    # reduction there would be in_loop_reductions), and the stacked layers'
    # reductions run inside the last microbatch's backward layer scan.
    ht.assert_reduced_once_per_step(module)
    overlapped = ht.overlapped_reductions(module)
    assert overlapped
    assert all(OVERLAPPED_SCOPE in c.op_name and len(c.loops) == 1 for c in overlapped)
    # Once per step in total: trip-count-weighted bytes equal the plain path's.
    assert _reduction_bytes(module) == _reduction_bytes(_plain(setup).as_text())
    # Pipelined by one layer: the scan reduces layers L-1..1, one per iteration
    # (each during the next lower layer's backward); layer 0 after the scan.
    layers = jax.tree.leaves(setup.params["layers"])[0].shape[0]
    assert {c.multiplier for c in overlapped} == {layers - 1}


def _after(jaxpr, source) -> set:
    """Indices of `jaxpr`'s top-level equations that depend on equation `source`'s outputs."""
    reached = set(source.outvars)
    after = set()
    for k, eqn in enumerate(jaxpr.eqns):
        if any(isinstance(v, jax.extend.core.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
            after.add(k)
    return after


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_overlap_runs_the_last_microbatch_after_the_loop(get_setup, mode):
    """Every matmul of the last microbatch depends on the loop over the first N-1.

    Its forward needs nothing from the accumulator, so without that dependence XLA
    may schedule it before the loop and keep what it saves for the backward live
    across all N-1 microbatches (XLA:TPU did: 6.49 GiB per device instead of 6.00
    on deepseek3-small ZeRO-1 GA=4, v5e-8).
    """
    setup = get_setup("data8", mode)
    trace = jax.make_jaxpr(
        lambda p, b: accum.accumulate_gradients(
            setup.model.loss_fn, p, b, num_microbatches=N, schedule="overlapped"
        )
    )
    with jax.set_mesh(setup.mesh):
        jaxpr = trace(setup.params, setup.batch).jaxpr
    # The microbatch loop is traced first; the top-level scans after it are the
    # last microbatch's layer scans.
    loop = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    assert loop.params["length"] == N - 1
    after = _after(jaxpr, loop)
    matmuls = [k for k, e in enumerate(jaxpr.eqns) if e is not loop and "dot_general" in str(e)]
    assert matmuls and set(matmuls) <= after, [jaxpr.eqns[k].primitive.name for k in matmuls]


def _reduction_bytes(text_or_module):
    """Gradient-reduction bytes per step: floating arrays (not scalars: XLA may fold a
    loss sum into a gradient reduction on one path only), trip-count weighted. A
    per-layer reduce-scatter can leave few elements per device: no size cutoff."""
    module = ht.parse(text_or_module) if isinstance(text_or_module, str) else text_or_module
    return sum(
        c.multiplier * sum(a.bytes for a in c.arrays if a.elements > 1 and a.dtype in FLOATS)
        for c in ht.collectives(module)
        if c.kind in ht.REDUCTION_KINDS and c.cross_replica
    )


def _overlap_onto_zero1(setup, close, schedule="overlapped"):
    """The `schedule` (an overlapped one) compiled onto ZeRO-1 targets (cached), its
    grads checked against the full batch's and on the targets' partitions; the compiled."""
    targets = accum.zero1_shardings(setup.params)
    _, ref_grads = setup.reference()
    fn = setup.cached(
        ("overlap-zero1", schedule),
        lambda: (
            jax.jit(
                lambda p, b: accum.accumulate_gradients(
                    setup.model.loss_fn,
                    p,
                    b,
                    num_microbatches=N,
                    schedule=schedule,
                    grad_shardings=targets,
                )
            )
            .lower(setup.params, setup.batch)
            .compile()
        ),
    )
    _, _, grads = fn(setup.params, setup.batch)
    close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(targets), strict=True):
        assert spec_of(g).partitions == t.spec.partitions
    return fn


def test_overlap_onto_zero1_shards(get_setup, close):
    """The last microbatch's per-layer reduction lands on ZeRO-1 shards (reduce-scatter)."""
    fn = _overlap_onto_zero1(get_setup("data8"), close)
    overlapped = ht.overlapped_reductions(fn.as_text())
    assert overlapped and all(c.kind == "reduce-scatter" for c in overlapped)


@pytest.mark.parametrize("mesh", ["data8", "data2_expert4"])
def test_ring_reduce_scatter_onto_zero1_shards(get_setup, close, mesh):
    """schedule="overlapped_ring": the per-layer reduce-scatters become one ring of n-1
    collective-permutes per layer (accum.ring), same numbers and shards; on
    data2_expert4 the axes the shards leave unsharded are psummed after the ring."""
    setup = get_setup(mesh)
    targets = accum.zero1_shardings(setup.params)
    fn = _overlap_onto_zero1(setup, close, schedule="overlapped_ring")
    module = ht.parse(fn.as_text())
    if mesh == "data8":
        # (data2_expert4's expert layer all-reduces activations over 'expert' in
        # every loop: not gradients, but the assertion cannot tell them apart.)
        ht.assert_reduced_once_per_step(module)
    in_scan = ht.overlapped_reductions(module)
    rings = [c for c in in_scan if ht.is_ring_reduction(c)]
    assert rings and not [c for c in in_scan if c.kind == "reduce-scatter"]
    # Rings per layer (one per dtype and psummed-axes set; one on data8), n-1
    # permutes each, one shard of the layer's ring bucket per permute.
    ring_size = setup.mesh.shape["data"]
    layers = jax.tree.leaves(setup.params["layers"])[0].shape[0]
    assert len(rings) % (ring_size - 1) == 0
    if mesh == "data8":
        assert len(rings) == ring_size - 1
    assert {c.multiplier for c in rings} == {layers - 1}
    sharded = _scan_shard_bytes(setup, targets, layers)
    assert sum(c.bytes for c in rings) == (ring_size - 1) * sharded
    # Layer 0's and the unstacked leaves' reductions onto shards go as rings too
    # (each unstacked leaf its own, to start as soon as its gradient is final).
    after = ht.gradient_reductions_outside(module)
    assert any(ht.is_ring_reduction(c) for c in after)
    assert not [c for c in after if c.kind == "reduce-scatter"]


@pytest.mark.parametrize(
    ("mode", "policy", "schedule", "error"),
    [
        (
            "explicit",
            "per_microbatch",
            "overlapped_ring",
            "schedule='overlapped_ring' does nothing under policy='per_microbatch'",
        ),
        ("auto", "deferred", "overlapped_ring", "schedule='overlapped_ring' needs explicit mode"),
        ("explicit", "deferred", "ring", "schedule='ring' is not one of"),
    ],
)
def test_meaningless_schedule_is_refused(get_setup, mode, policy, schedule, error):
    """One line naming the schedule and what it cannot go with, at trace time."""
    setup = get_setup("data8", mode)
    with pytest.raises(ValueError, match=error):
        jax.eval_shape(
            lambda p, b: accum.accumulate_gradients(
                setup.model.loss_fn,
                p,
                b,
                num_microbatches=N,
                plan=accum.plan_for(p, b, policy=policy),
                schedule=schedule,
            ),
            setup.params,
            setup.batch,
        )


def test_add_refuses_the_overlapped_schedules(get_setup):
    """add accumulates one microbatch; the overlapped reduction needs the last one."""
    setup = get_setup("data8")
    # One microbatch of two, placed like the batch (the strided split).
    microbatch = jax.tree.map(lambda x: jax.device_put(np.asarray(x)[::2], x.sharding), setup.batch)
    with jax.set_mesh(setup.mesh):
        # Abstract only: the refusal comes before anything is traced.
        acc = jax.eval_shape(partial(accum.start, setup.model.loss_fn), setup.params, microbatch)
        with pytest.raises(ValueError, match="add: schedule='overlapped' reduces inside"):
            jax.eval_shape(
                lambda a, p, b: accum.add(a, setup.model.loss_fn, p, b, schedule="overlapped"),
                acc,
                setup.params,
                microbatch,
            )


def _scan_shard_bytes(setup, targets, layers) -> int:
    """Bytes of one layer's ZeRO-1 shards (per device) of the stacked leaves the
    ring reduces: those whose shard lies off the layer axis."""
    total = 0
    for p, t in zip(
        jax.tree.leaves(setup.params["layers"]),
        jax.tree.leaves(accum.zero1_shardings(setup.params["layers"])),
        strict=True,
    ):
        parts = t.spec.partitions
        if parts and parts[0] is not None:
            continue  # sharded on the layer axis: reduced after the scan
        if "data" not in str(parts):
            continue  # too small to shard: an all-reduce
        per_device = t.shard_shape(p.shape)
        total += int(np.prod(per_device[1:])) * p.dtype.itemsize
    return total


# A standalone stack: closed-over weights, a second use of the stack (weight decay),
# integer outputs, and the single-microbatch edge.
L, D = 3, 8


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _stack_problem(mode):
    mesh = jax.make_mesh(
        (8,),
        ("data",),
        axis_types=(
            jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto,
        ),
    )
    rng = np.random.default_rng(0)
    params = {
        "stack": {"w": rng.normal(size=(L, D, D)).astype(np.float32) * 0.3},
        "shared": np.ones((D,), np.float32),
    }
    batch = {
        "x": rng.normal(size=(32, D)).astype(np.float32),
        "weight": np.ones((32,), np.float32),
    }
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    return mesh, params, batch


def _stack_loss(decay):
    def loss_fn(p, mb):
        shared = p["shared"]

        def body(h, layer):
            h = jnp.tanh(h @ (layer["w"] * shared[None, :]))
            return h, (jnp.sum(h), jnp.argmax(jnp.sum(h, axis=0)))

        h, (sums, _) = accum.scan_layers(body, mb["x"], p["stack"])
        loss = jnp.sum(h * h * mb["weight"][:, None]) + 0.1 * jnp.sum(sums)
        weight = jnp.sum(mb["weight"])
        if decay:
            # Scaled by the weight (the README's rule for terms of the parameters
            # alone): the same on the tags path (fused) and on the local path an
            # auto mesh takes by default (plain), where an unscaled term would be
            # added once per device.
            loss = loss + 1e-2 * weight * jnp.sum(p["stack"]["w"] * p["stack"]["w"])
        return loss, {"weight": weight}

    return loss_fn


@pytest.mark.parametrize(
    ("mode", "decay", "n"),
    [("explicit", False, 4), ("explicit", False, 1), ("auto", True, 4)],
)
def test_closures_second_uses_and_integer_outputs(close, mode, decay, n):
    mesh, params, batch = _stack_problem(mode)
    loss_fn = _stack_loss(decay)
    with jax.set_mesh(mesh):
        plain = jax.jit(lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=n))
        want = plain(params, batch)
        for how in ("fused", "overlapped"):
            got = jax.jit(
                lambda p, b, how=how: accum.accumulate_gradients(
                    loss_fn, p, b, num_microbatches=n, schedule=how
                )
            )(params, batch)
            close(got[0], want[0], rtol=1e-6)
            close(got[2], want[2], rtol=1e-5, atol=1e-7)


def _toy_model(p, x):
    h, _ = accum.scan_layers(lambda c, w: (jnp.tanh(c @ w), None), x, p["stack"]["w"])
    return h @ p["shared"]


def _lax_map_loss(p, mb):
    # The model applied to two views inside lax.map: its backward runs twice.
    views = jnp.stack([mb["x"], 2.0 * mb["x"]])
    outs = jax.lax.map(lambda x: jnp.sum(_toy_model(p, x) * mb["weight"]), views)
    return jnp.sum(outs), {"weight": jnp.sum(mb["weight"])}


def _vmap_loss(p, mb):
    # A per-example model: the backward's sink cotangent is summed over the rows.
    out = jax.vmap(lambda row: _toy_model(p, row[None])[0])(mb["x"])
    return jnp.sum(out * mb["weight"]), {"weight": jnp.sum(mb["weight"])}


def _cond_skip_loss(p, mb):
    # The model skipped on a microbatch with nothing counted: its backward never runs.
    n = jnp.sum(mb["weight"])
    loss = jax.lax.cond(
        n > 0, lambda: jnp.sum(_toy_model(p, mb["x"]) * mb["weight"]), lambda: jnp.float32(0)
    )
    return loss, {"weight": n}


def _stop_gradient_loss(p, mb):
    # The stack's first call (which claims it) never reaches the loss's gradient.
    target = jax.lax.stop_gradient(_toy_model(p, 2.0 * mb["x"]))
    pred = _toy_model(p, mb["x"])
    return jnp.sum((pred - target) ** 2 * mb["weight"]), {"weight": jnp.sum(mb["weight"])}


@pytest.mark.parametrize(
    ("loss_fn", "mode", "nested"),
    [
        (_lax_map_loss, "explicit", True),
        (_vmap_loss, "auto", True),
        (_cond_skip_loss, "explicit", True),
        (_stop_gradient_loss, "explicit", False),
    ],
    ids=["lax_map", "vmap", "cond_skip", "stop_gradient"],
)
def test_a_stack_whose_backward_runs_other_than_once(close, loss_fn, mode, nested):
    # The stack's backward returns acc + gradient as a cotangent, which autodiff sums
    # over every run: twice counted the accumulator, none lost it (silently). Such a
    # call now takes the ordinary path; a nested one says so.
    mesh, params, batch = _stack_problem(mode)
    if loss_fn is _cond_skip_loss:  # the strided split's microbatch 1 counts nothing
        batch["weight"] = jnp.where(jnp.arange(32) % 2 == 0, batch["weight"], 0.0)

    def reference(p):
        loss, aux = loss_fn(p, jax.device_get(batch))
        return loss / aux["weight"]

    want = jax.grad(reference)(jax.device_get(params))
    with jax.set_mesh(mesh):
        for how in ("fused", "overlapped"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _, _, got = jax.jit(
                    lambda p, b, how=how: accum.accumulate_gradients(
                        loss_fn, p, b, num_microbatches=2, schedule=how
                    )
                )(params, batch)
            close(got, want, rtol=1e-5, atol=1e-6)
            said = [w for w in caught if "scan_layers runs inside" in str(w.message)]
            assert bool(said) == nested, [str(w.message) for w in caught]


def test_scan_layers_is_lax_scan_outside_accumulation():
    w = jnp.arange(2 * 3 * 3, dtype=jnp.float32).reshape(2, 3, 3) / 10

    def body(x, w_layer):
        return jnp.tanh(x @ w_layer), x.sum()

    got = accum.scan_layers(body, jnp.ones(3), w)
    want = jax.lax.scan(body, jnp.ones(3), w)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_overlapped_scope_is_hlo_tools_contract():
    assert OVERLAPPED_SCOPE == ht.OVERLAPPED_SCOPE


def test_add_fused_matches_add(get_setup, close):
    """start / add(schedule="fused") / finish: same result as the plain add, per microbatch."""
    setup = get_setup("data8")
    microbatches = accum.split_microbatches(setup.batch, 2)

    def run(schedule):
        def fn(params, batch):
            acc = accum.start(setup.model.loss_fn, params, jax.tree.map(lambda x: x[0], batch))
            for i in range(2):
                mb = jax.tree.map(lambda x, i=i: x[i], batch)
                acc = accum.add(acc, setup.model.loss_fn, params, mb, schedule=schedule)
            return accum.finish(acc)

        with jax.set_mesh(setup.mesh):
            return jax.jit(fn)(setup.params, microbatches)

    want, got = run("plain"), run("fused")
    close(got[0], want[0], rtol=1e-6)
    close(got[2], want[2], rtol=1e-5, atol=1e-7)


def _buffers(setup, schedule, targets=None):
    """(compiled HLO text, buffer-assignment text) of the accumulation under `schedule`
    compiled for `setup` (own compile: the buffer assignment is only written when
    asked for)."""

    def build():
        def fn(params, batch):
            return accum.accumulate_gradients(
                setup.model.loss_fn,
                params,
                batch,
                num_microbatches=N,
                schedule=schedule,
                grad_shardings=targets,
            )

        lowered = jax.jit(fn).lower(setup.params, setup.batch)
        compiled, buffers = ht.compile_with_buffers(lowered)
        return compiled.as_text(), buffers

    return setup.cached(("buffers", schedule, targets is not None), build)


def _loop_buffers(setup, schedule, targets=None):
    """hlo_tools.loop_buffers of `_buffers`' compile."""
    return ht.loop_buffers(_buffers(setup, schedule, targets)[1])


def _per_device_shape(leaf, sharding) -> str:
    return f"f32[{','.join(map(str, sharding.shard_shape(leaf.shape)))}]"


# The ring stores its results the same way; its compile is in the slow tier.
@pytest.mark.parametrize("ring", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_overlap_keeps_reduced_layers_in_the_accumulator(get_setup, ring):
    """The last microbatch writes each layer's reduced ZeRO-1 shard into that layer's
    (dead) slice of the accumulator: its backward layer scan carries no stacked
    buffer of the shards beside the accumulator, which is live there anyway (the
    step's peak is at the start of that scan)."""
    setup = get_setup("data8")
    targets = accum.zero1_shardings(setup.params)
    carried = _loop_buffers(setup, "overlapped_ring" if ring else "overlapped", targets)
    layers = jax.tree.leaves(setup.params["layers"])
    accumulators = {_per_device_shape(leaf, leaf.sharding) for leaf in layers}
    shards = {
        _per_device_shape(leaf, target)
        for leaf, target in zip(layers, jax.tree.leaves(targets["layers"]), strict=True)
    }
    # Shapes no loop of the fused path carries (a shard shape can equal an
    # activation stack's, e.g. layers x tokens x embed): none of them either.
    fused = _loop_buffers(setup, "fused", targets)
    unambiguous = {s for s in shards - accumulators if not fused.get(s, 0)}
    assert unambiguous
    for shape in unambiguous:
        assert carried.get(shape, 0) == 0, (shape, carried)


def _squeezed(shape: str) -> str:
    """`f32[1,3,16,32]` -> `f32[3,16,32]`: JAX 0.12.1 carries some stacks with a unit
    dimension that 0.10.2 does not (the same buffer, the same bytes)."""
    dtype, dims = shape.rstrip("]").split("[", 1)
    return f"{dtype}[{','.join(d for d in dims.split(',') if d and d != '1')}]"


def _carrying_loops(setup, schedule, targets):
    """{(allocation, offset, squeezed shape): {trip counts of the while loops carrying
    the value there}} over the loop-carried buffers of the compiled accumulation.

    XLA names a while loop's carried value after the loop (`while.393{6}`: element 6
    of while.393's state); one buffer carried by two loops is one value in both."""
    text, buffers = _buffers(setup, schedule, targets)
    module = ht.parse(text)
    graph = ht.call_graph(module)
    trips = {
        i.name: graph.loop(module.computations[i.computation], i).trip_count
        for i in module.instructions()
        if i.opcode == "while"
    }
    slots = {}
    for allocation in ht.parse_buffer_assignment(buffers):
        for value in allocation.values:
            loop = value.name.split("{", 1)[0]
            if value.loop_carried and loop in trips:
                key = (allocation.index, value.offset, _squeezed(value.shape))
                slots.setdefault(key, []).append((loop, trips[loop]))
    return slots


@pytest.mark.parametrize(
    ("mesh", "zero1"), [("data8", False), ("data8", True), ("data4_fsdp2", False)]
)
def test_fused_holds_no_per_microbatch_gradient_buffer(get_setup, toy, mesh, zero1):
    """The fused backward layer scan adds each layer's gradient into the accumulator
    the microbatch loop carries: every buffer of a stacked leaf's (per-device) shape
    that scan carries is that accumulator, one per leaf. A per-microbatch gradient
    (the plain path's stacked gradient of the current microbatch, added to the
    accumulator after the scan) would be a buffer the scan carries and the
    microbatch loop does not; the plain path has no layer loop sharing a buffer with
    the microbatch loop at all (both fail here)."""
    assert toy.LAYERS != N  # the loops are told apart by their trip counts
    setup = get_setup(mesh)
    targets = accum.zero1_shardings(setup.params) if zero1 else None
    slots = _carrying_loops(setup, "fused", targets)
    stacked = {}
    for leaf in jax.tree.leaves(setup.params["layers"]):
        shape = _squeezed(_per_device_shape(leaf, leaf.sharding))
        stacked[shape] = stacked.get(shape, 0) + 1
    # The backward scan: the layer loop whose carried buffers the microbatch loop
    # carries too (the forward scan shares none: it keeps the layers' residuals).
    backward = {
        name
        for loops in slots.values()
        if N in {trips for _, trips in loops}
        for name, trips in loops
        if trips == toy.LAYERS
    }
    assert len(backward) == 1, (backward, slots)
    for shape, leaves in stacked.items():
        carried = [loops for (_, _, s), loops in slots.items() if s == shape]
        in_backward = [
            {trips for _, trips in loops} for loops in carried if backward & {n for n, _ in loops}
        ]
        assert len(in_backward) == leaves, (shape, carried)
        assert all(N in trips for trips in in_backward), (shape, carried)
