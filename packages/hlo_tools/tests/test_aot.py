"""The example programs compiled for TPU v5e:2x4 ahead of time on this host (libtpu)."""

import pytest

import hlo_tools as ht

pytestmark = pytest.mark.aot


@pytest.fixture(scope="module")
def tpu(programs):
    pytest.importorskip("libtpu")
    return {tagged: programs.compile_tpu(tagged) for tagged in (True, False)}


def test_tagged_reduces_once_after_the_loops(tpu, programs):
    text = tpu[True]
    (c,) = ht.collectives(text)
    assert not c.in_loop and c.shape == (programs.LAYERS, programs.TPU_WIDTH, programs.TPU_WIDTH)
    assert c.group_size == 8
    ht.assert_reduced_once_per_step(text)
    # TPU tiles show up in the layouts the parser had to read.
    assert ":T(8,128)" in text


def test_replicated_reduces_per_layer_and_microbatch(tpu, programs):
    text = tpu[False]
    (c,) = ht.collectives(text)
    assert c.multiplier == programs.LAYERS * programs.MICROBATCHES
    assert [lp.trip_count for lp in c.loops] == [programs.MICROBATCHES, programs.LAYERS]
    with pytest.raises(AssertionError, match="inside a loop"):
        ht.assert_reduced_once_per_step(text)


def test_zero1_reduce_scatter_sits_in_a_fusion(tpu, programs):
    # Resharding the unreduced gradient to P(None, 'data', None) asks for a
    # reduce-scatter; on TPU it compiles to a kCustom fusion around an all-reduce.
    module = ht.parse(programs.compile_tpu(True, scatter=True))
    (c,) = ht.collectives(module)
    assert not c.in_loop and c.via
    caller = next(i for i in module.instructions() if i.name == c.via[-1])
    assert caller.opcode == "fusion" and caller.attributes.get("kind") == "kCustom"
    # The bare all-reduce has no metadata; the fusion's op_name is reported.
    assert "reshard" in c.op_name
    ht.assert_reduced_once_per_step(module)


def test_async_start_done_pairs_of_a_tpu_schedule():
    # An all-gather feeding a matmul beside a psum, compiled for v5e-8. XLA decides
    # what runs asynchronously and what overlaps; the parser must find every
    # start's done and count each collective once.
    pytest.importorskip("libtpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(topologies.get_topology_desc("v5e:2x4", "tpu").devices), ("data",))

    def f(x, w, y):
        g = jax.lax.psum(x @ w, "data")
        h = jnp.tanh(jax.lax.all_gather(y, "data", tiled=True) @ w)
        return g, h

    step = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("data"), P(), P("data")),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    arg = lambda shape, spec: jax.ShapeDtypeStruct(
        shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    )  # noqa: E731
    text = (
        step.lower(
            arg((1024, 1024), P("data")), arg((1024, 1024), P()), arg((1024, 1024), P("data"))
        )
        .compile()
        .as_text()
    )
    module = ht.parse(text)
    pairs = ht.async_pairs(module)
    assert pairs, "no async start in the schedule: the test no longer exercises pairing"
    assert all(p.done is not None for p in pairs.values())
    records = ht.async_overlap(module)
    assert sorted(r.kind for r in records) == ["all-gather", "all-reduce"]
    for r in records:
        if r.is_async:
            assert pairs[(r.computation, r.start)].done == r.done
    assert any(r.is_async for r in records)
