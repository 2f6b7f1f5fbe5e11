"""reaches_root: a gradient's reduction flows into the loop's carry; an activation's into a dot."""
# ruff: noqa: E501  (HLO text: one instruction per line, as XLA prints it)

import pytest

import hlo_tools as ht

# An outer (microbatch) loop whose body runs an inner (layer) loop. The inner body
# all-reduces a tuple: element 0 is a layer's gradient (converted, written into
# the stacked gradient the inner loop carries), element 1 an activation cotangent
# (a fusion's dot consumes it). The outer body adds the stacked gradient into its
# accumulator. %norm_ct is reduced, then summed over its elements (a norm's
# backward): past a reduce it is compute, not a carried value.
HLO = """
HloModule step, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%dot_fusion (x: f32[4,8], w: f32[8,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%scale_fusion (g: f32[8,8]) -> bf16[8,8] {
  %g = f32[8,8]{1,0} parameter(0)
  ROOT %c = bf16[8,8]{1,0} convert(%g)
}

%inner_body (p: (s32[], bf16[2,8,8], f32[4,8], f32[8,8])) -> (s32[], bf16[2,8,8], f32[4,8], f32[8,8]) {
  %p = (s32[], bf16[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = bf16[2,8,8]{2,1,0} get-tuple-element(%p), index=1
  %h = f32[4,8]{1,0} get-tuple-element(%p), index=2
  %w = f32[8,8]{1,0} get-tuple-element(%p), index=3
  %partial = f32[8,8]{1,0} multiply(%w, %w)
  %both = (f32[8,8]{1,0}, f32[4,8]{1,0}) all-reduce(%partial, %h), replica_groups={{0,1,2,3}}, to_apply=%add
  %grad = f32[8,8]{1,0} get-tuple-element(%both), index=0
  %act = f32[4,8]{1,0} get-tuple-element(%both), index=1
  %grad16 = bf16[8,8]{1,0} fusion(%grad), kind=kLoop, calls=%scale_fusion
  %grad3 = bf16[1,8,8]{2,1,0} reshape(%grad16)
  %zero = s32[] constant(0)
  %stack2 = bf16[2,8,8]{2,1,0} dynamic-update-slice(%stack, %grad3, %i, %zero, %zero)
  %next_h = f32[4,8]{1,0} fusion(%act, %w), kind=kOutput, calls=%dot_fusion
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%i2, %stack2, %next_h, %w)
}

%inner_cond (p: (s32[], bf16[2,8,8], f32[4,8], f32[8,8])) -> pred[] {
  %p = (s32[], bf16[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(2)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (q: (s32[], f32[2,8,8], f32[4,8], f32[8,8])) -> (s32[], f32[2,8,8], f32[4,8], f32[8,8]) {
  %q = (s32[], f32[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %acc = f32[2,8,8]{2,1,0} get-tuple-element(%q), index=1
  %x = f32[4,8]{1,0} get-tuple-element(%q), index=2
  %w = f32[8,8]{1,0} get-tuple-element(%q), index=3
  %norm_ct = f32[4,8]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %c0 = f32[] constant(0)
  %norm_sum = f32[8]{0} reduce(%norm_ct, %c0), dimensions={0}, to_apply=%add
  %z = s32[] constant(0)
  %empty = bf16[2,8,8]{2,1,0} broadcast(%c0), dimensions={}
  %init = (s32[], bf16[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%z, %empty, %x, %w)
  %layers = (s32[], bf16[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) while(%init), condition=%inner_cond, body=%inner_body
  %stacked = bf16[2,8,8]{2,1,0} get-tuple-element(%layers), index=1
  %wide = f32[2,8,8]{2,1,0} convert(%stacked)
  %acc2 = f32[2,8,8]{2,1,0} add(%acc, %wide)
  %one = s32[] constant(1)
  %j2 = s32[] add(%j, %one)
  ROOT %r = (s32[], f32[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%j2, %acc2, %x, %w)
}

%outer_cond (q: (s32[], f32[2,8,8], f32[4,8], f32[8,8])) -> pred[] {
  %q = (s32[], f32[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x: f32[4,8], w: f32[8,8]) -> f32[2,8,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %c0 = f32[] constant(0)
  %zeros = f32[2,8,8]{2,1,0} broadcast(%c0), dimensions={}
  %z = s32[] constant(0)
  %init = (s32[], f32[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%z, %zeros, %x, %w)
  %loop = (s32[], f32[2,8,8]{2,1,0}, f32[4,8]{1,0}, f32[8,8]{1,0}) while(%init), condition=%outer_cond, body=%outer_body
  ROOT %grads = f32[2,8,8]{2,1,0} get-tuple-element(%loop), index=1
}
"""


@pytest.fixture(scope="module")
def module():
    return ht.parse(HLO)


def test_a_gradient_reaches_the_outer_carry_through_a_fusion_and_the_inner_loop(module):
    assert ht.reaches_root(module, "inner_body", "both", target="outer_body", index=0)
    assert ht.reaches_root(module, "inner_body", "both", target="main", index=0)


def test_an_activation_cotangent_stops_at_the_dot_that_consumes_it(module):
    assert not ht.reaches_root(module, "inner_body", "both", target="outer_body", index=1)
    # The whole tuple holds the gradient too.
    assert ht.reaches_root(module, "inner_body", "both", target="outer_body")


def test_a_value_summed_over_its_elements_is_not_carried(module):
    assert not ht.reaches_root(module, "outer_body", "norm_ct", target="outer_body")
    assert ht.contracts(module.computations["outer_body"].by_name["norm_sum"])


def test_a_carried_input_reaches_the_carry_but_not_past_the_loop(module):
    # %x is carried through the outer loop unchanged, yet never the program's output:
    # in the inner loop it joins the combined all-reduce as element 1 (the activation).
    assert ht.reaches_root(module, "outer_body", "x", target="outer_body")
    assert not ht.reaches_root(module, "outer_body", "x", target="main")
    # %w flows through the multiply into the gradient, so into the output.
    assert ht.reaches_root(module, "outer_body", "w", target="main")


# Two gradients of one shape, all-reduced together, each added into its own
# accumulator (op_names marked acc[k]) by one multi-output fusion whose own
# op_name names only one of them: the value is told by the addition it enters.
MARKED = """
HloModule marked, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%adds (g0: f32[16], g1: f32[16], a0: f32[16], a1: f32[4]) -> (f32[16], f32[4]) {
  %g0 = f32[16]{0} parameter(0)
  %g1 = f32[16]{0} parameter(1)
  %a0 = f32[16]{0} parameter(2)
  %a1 = f32[4]{0} parameter(3)
  %s0 = f32[16]{0} add(%a0, %g0), metadata={op_name="jit(step)/while/body/acc[0]/add"}
  %zero = s32[] constant(0)
  %slice = f32[4]{0} dynamic-slice(%g1, %zero), dynamic_slice_sizes={4}, metadata={op_name="jit(step)/while/body/transpose(jvp())/dynamic_slice"}
  %s1 = f32[4]{0} add(%a1, %slice), metadata={op_name="jit(step)/while/body/acc[1]/add"}
  ROOT %both = (f32[16]{0}, f32[4]{0}) tuple(%s0, %s1)
}

ENTRY %main (x: f32[16], y: f32[16], a0: f32[16], a1: f32[4]) -> (f32[16], f32[4]) {
  %x = f32[16]{0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %a0 = f32[16]{0} parameter(2)
  %a1 = f32[4]{0} parameter(3)
  %r = (f32[16]{0}, f32[16]{0}) all-reduce(%x, %y), replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(step)/while/body/transpose(jvp())/reduce_sum"}
  %r0 = f32[16]{0} get-tuple-element(%r), index=0
  %r1 = f32[16]{0} get-tuple-element(%r), index=1
  ROOT %f = (f32[16]{0}, f32[4]{0}) fusion(%r0, %r1, %a0, %a1), kind=kLoop, calls=%adds, metadata={op_name="jit(step)/while/body/acc[0]/add"}
}
"""


def test_first_marked_tells_same_shaped_values_by_the_addition_they_enter():
    module = ht.parse(MARKED)
    pattern = r"acc\[(\d+)\]"
    assert ht.first_marked(module, "main", "r", pattern=pattern, index=0) == {"0"}
    assert ht.first_marked(module, "main", "r", pattern=pattern, index=1) == {"1"}
    assert ht.first_marked(module, "main", "r", pattern=pattern) == {"0", "1"}
    assert ht.first_marked(module, "main", "x", pattern=pattern) == {"0"}
    assert ht.first_marked(module, "main", "r", pattern=r"nowhere\[(\d+)\]") == set()
