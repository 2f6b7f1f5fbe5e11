"""Reading XLA's buffer assignment: allocations, values, loop-carried buffers per shape."""

import pytest

import hlo_tools as ht

# Lines as XLA:CPU writes them (trimmed): a parameter, the output, and the temp
# arena where a while loop's state (phi values) lives.
SNIPPET = """\
BufferAssignment:
allocation 0: size 2048, parameter 0, shape |f32[2,16,16]| at ShapeIndex {}:
 value: <220 param.8 @0> (size=2048,offset=0): f32[2,16,16]{2,1,0}
allocation 1: size 2048, maybe-live-out:
 value: <192 wrapped_add.3 @0> (size=2048,offset=0): f32[2,16,16]{2,1,0}
 value: <290 while.98{1} (phi) @0> (size=2048,offset=0): f32[2,16,16]{2,1,0}
allocation 2: size 4200, preallocated-temp:
 value: <159 fusion.3 @0> (size=2048,offset=0): f32[2,16,16]{2,1,0}
 value: <271 while.99{2} (phi) @0> (size=2048,offset=0): f32[2,16,16]{2,1,0}
 value: <263 wide.param.11{2} (phi) @0> (size=2048,offset=0): f32[2,16,16]{2,1,0}
 value: <270 while.99{} (phi) @0> (size=16,offset=4096): (s32[], f32[2,16,16]{2,1,0})
 value: <272 while.99{0} (phi) @0> (size=4,offset=4112): s32[]
 value: <273 while.97{0} (phi) @0> (size=4,offset=4112): s32[]
"""


def test_parse_allocations_and_values():
    allocations = ht.parse_buffer_assignment(SNIPPET)
    assert [(a.index, a.size) for a in allocations] == [(0, 2048), (1, 2048), (2, 4200)]
    assert allocations[0].kind.startswith("parameter 0")
    assert allocations[2].kind == "preallocated-temp"
    phi = allocations[2].values[1]
    assert (phi.name, phi.size, phi.offset, phi.shape, phi.loop_carried) == (
        "while.99{2}",
        2048,
        0,
        "f32[2,16,16]",
        True,
    )
    assert not allocations[2].values[0].loop_carried


def test_loop_buffers_counts_distinct_slots_per_shape():
    # f32[2,16,16]: the output's slot and one temp slot (two phis share it);
    # the tuple-shaped loop state is left out; both s32[] counters share one slot.
    assert ht.loop_buffers(SNIPPET) == {"f32[2,16,16]": 2, "s32[]": 1}


def test_not_a_buffer_assignment_raises():
    with pytest.raises(ht.HloParseError, match="not a buffer-assignment"):
        ht.parse_buffer_assignment("HloModule m\nENTRY e { ROOT c = f32[] constant(0) }")


def test_compile_with_buffers_reads_this_compile():
    """An accumulation loop compiled here carries its accumulator across iterations."""
    import jax
    import jax.numpy as jnp

    def summed(x_NxD):
        return jax.lax.scan(lambda acc, row: (acc + jnp.tanh(row), None), x_NxD[0], x_NxD)[0]

    lowered = jax.jit(summed).lower(jax.ShapeDtypeStruct((5, 24), jnp.float32))
    compiled, text = ht.compile_with_buffers(lowered)
    assert "f32[24]" in ht.loop_buffers(text)
    assert compiled.as_text()
