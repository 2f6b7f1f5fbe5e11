# ruff: noqa: E501 -- HLO snippets are verbatim one-instruction-per-line text.
"""overlapped_reductions: the reductions of the last microbatch's backward layer scan,
found by accum's name scope and by their loop (XLA's combiner may drop the scope)."""

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
