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
