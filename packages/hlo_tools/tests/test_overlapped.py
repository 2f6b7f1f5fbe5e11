# ruff: noqa: E501 -- HLO snippets are verbatim one-instruction-per-line text.
"""overlapped_reductions: the reductions of the last microbatch's backward layer scan,
found by accum's name scope and by their loop (XLA's combiner may drop the scope)."""

import pytest

import hlo_tools as ht

# The last microbatch's backward layer scan (3 layers) after a microbatch loop: one
# reduction carries accum's scope, a second (XLA's combiner kept another op's name)
# does not; the microbatch loop holds a reduction of its own.
_OVERLAP_HLO = """HloModule overlap, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (t: (s32[], f32[64])) -> pred[] {
  %t = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %lim = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}

%layers (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[64]{0} get-tuple-element(%t), index=1
  %r1 = f32[64]{0} all-reduce(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/overlapped_gradient_reduction/reshard"}
  %r2 = f32[64]{0} all-reduce(%r1), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/while/body/add"}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[64]{0}) tuple(%n, %r2)
}

%microbatches (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[64]{0} get-tuple-element(%t), index=1
  %r = f32[64]{0} all-reduce(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(step)/while/body/add"}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[64]{0}) tuple(%n, %r)
}

ENTRY %main (g: f32[64]) -> f32[64] {
  %g = f32[64]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[64]{0}) tuple(%z, %g)
  %mb = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%microbatches
  %acc = f32[64]{0} get-tuple-element(%mb), index=1
  %init2 = (s32[], f32[64]{0}) tuple(%z, %acc)
  %last = (s32[], f32[64]{0}) while(%init2), condition=%cond, body=%layers
  ROOT %out = f32[64]{0} get-tuple-element(%last), index=1
}
"""


def test_overlapped_reductions_are_the_scoped_loops_reductions_combined_or_not():
    module = ht.parse(_OVERLAP_HLO)
    overlapped = ht.overlapped_reductions(module)
    assert sorted(c.name for c in overlapped) == ["r1", "r2"]
    # The microbatch loop's reduction stays a per-iteration one.
    assert [c.name for c in ht.in_loop_reductions(module)] == ["r"]
    assert (
        ht.OVERLAPPED_SCOPE in overlapped[0].op_name or ht.OVERLAPPED_SCOPE in overlapped[1].op_name
    )


# accum's ring reduce-scatter (accum.ring): collective-permutes under the scope. In
# the last microbatch's layer scan (a loop of its own) they are the overlapped
# reduction (p1; p2 lost the scope to another op's name, so is none); in a layer
# scan nested in the microbatch loop, a per-microbatch one (p3); a permute without
# the scope (ring attention's, a pipeline's) is no reduction at all (p4).
_RING = "source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}"
_SCOPED = 'metadata={op_name="jit(step)/transpose(jvp())/overlapped_gradient_reduction/ppermute"}'
_RING_HLO = f"""HloModule ring, num_partitions=8

%cond (t: (s32[], f32[64])) -> pred[] {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %lim = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}}

%last_layers (t: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[64]{{0}} get-tuple-element(%t), index=1
  %p1 = f32[64]{{0}} collective-permute(%g), {_RING}, {_SCOPED}
  %p2 = f32[64]{{0}} collective-permute(%p1), {_RING}, metadata={{op_name="jit(step)/add"}}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[64]{{0}}) tuple(%n, %p2)
}}

%layers (t: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[64]{{0}} get-tuple-element(%t), index=1
  %p3 = f32[64]{{0}} collective-permute(%g), {_RING}, {_SCOPED}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[64]{{0}}) tuple(%n, %p3)
}}

%microbatches (t: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %t = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[64]{{0}} get-tuple-element(%t), index=1
  %p4 = f32[64]{{0}} collective-permute(%g), {_RING}, metadata={{op_name="jit(step)/ppermute"}}
  %z = s32[] constant(0)
  %init = (s32[], f32[64]{{0}}) tuple(%z, %p4)
  %scan = (s32[], f32[64]{{0}}) while(%init), condition=%cond, body=%layers
  %acc = f32[64]{{0}} get-tuple-element(%scan), index=1
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[64]{{0}}) tuple(%n, %acc)
}}

ENTRY %main (g: f32[64]) -> f32[64] {{
  %g = f32[64]{{0}} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[64]{{0}}) tuple(%z, %g)
  %mb = (s32[], f32[64]{{0}}) while(%init), condition=%cond, body=%microbatches
  %acc = f32[64]{{0}} get-tuple-element(%mb), index=1
  %init2 = (s32[], f32[64]{{0}}) tuple(%z, %acc)
  %last = (s32[], f32[64]{{0}}) while(%init2), condition=%cond, body=%last_layers
  ROOT %out = f32[64]{{0}} get-tuple-element(%last), index=1
}}
"""


def test_ring_permutes_under_the_scope_are_reductions():
    module = ht.parse(_RING_HLO)
    by_name = {c.name: c for c in ht.collectives(module)}
    assert {n: c.kind for n, c in by_name.items()} == dict.fromkeys(
        ["p1", "p2", "p3", "p4"], "collective-permute"
    )
    assert [n for n, c in by_name.items() if ht.is_ring_reduction(c)] == ["p1", "p3"]
    # p2 is in the overlapped loop but no reduction: a permute is one only by its scope.
    assert [c.name for c in ht.overlapped_reductions(module)] == ["p1"]
    # A ring inside the microbatch loop is a per-microbatch reduction, like an all-reduce.
    assert [c.name for c in ht.in_loop_reductions(module)] == ["p3"]
    with pytest.raises(AssertionError, match="collective-permute"):
        ht.assert_reduced_once_per_step(module)
    assert ht.overlap_report(module)["gradient_reductions"]["count"] == 2
