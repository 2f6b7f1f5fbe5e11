"""kernels_per_step on a small thunk sequence written as XLA:GPU writes it.

A real dump (a jitted nested scan compiled for a compile-only GPU) is counted in
the trainer's aot tier (packages/trainer/tests/test_aot_gpu.py).
"""

import pytest

import hlo_tools as ht
from hlo_tools import thunks

# Two nested counted loops: %w_out (4 trips) in ENTRY, %w_in (3 trips) in its body.
HLO = """HloModule m

%cond_in (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%p, %c), direction=LT
}

%body_in (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %n = s32[] add(%p, %one)
}

%cond_out (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %c = s32[] constant(4)
  ROOT %lt = pred[] compare(%p, %c), direction=LT
}

%body_out (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %w_in = s32[] while(%p), condition=%cond_in, body=%body_in, backend_config={TRIPS_3}
}

ENTRY %main () -> s32[] {
  %z = s32[] constant(0)
  ROOT %w_out = s32[] while(%z), condition=%cond_out, body=%body_out, backend_config={TRIPS_4}
}
"""
HLO = HLO.replace("{TRIPS_3}", '{"known_trip_count":{"n":"3"}}')
HLO = HLO.replace("{TRIPS_4}", '{"known_trip_count":{"n":"4"}}')

# The quirks: `condition:` at column 0, `body:` indented, a kDynamicSliceFusion and
# a kAsyncStart wrapping children, a kAsyncDone that waits.
SEQUENCE = """\
001: kCustomKernel [source | next=002 (1)] loop_broadcast_fusion grid: [1, 1, 1] threads: [1, 1, 1]
002: kAsyncStart   [prev=001 (1) | next=003 (1)] stream=communication_stream[0], async_id=2
    003: kAllReduce [source | sink] kAllReduce
004: kAsyncDone    [source | sink] async_id=2
005: kWhile        [prev=004 (1) | next=020 (1)]
condition:
    006: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    007: kDynamicSliceFusion [source | next=009 (1)] params=1, results=1
        008: kCopy [source | sink] kCopy
    009: kCustomKernel       [prev=007 (1) | next=010 (1)] input_transpose_fusion grid: [4, 1, 1]
    010: kWhile              [prev=009 (1) | next=016 (1)]
condition:
        011: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]
      body:
        012: kCustomKernel [source | next=013 (1)] gemm_fusion_dot_general grid: [32, 1, 1]
        013: kGemm         [prev=012 (1) | next=014 (1)] kGemm
        014: kCustomKernel [prev=013 (1) | sink] loop_add_fusion grid: [32, 1, 1]
        015: kCubSort      [source | sink] kCubSort
    016: kCustomKernel       [prev=010 (1) | sink] loop_dynamic_update_slice_fusion grid: [4, 1, 1]
020: kCopy         [prev=005 (1) | sink] kCopy
"""

METADATA = """\
thunk_metadata {
  thunk_info {
    profile_annotation: "loop_broadcast_fusion"
    thunk_id: 1
  }
  thunk_kind: "kCustomKernel"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "w_out"
    thunk_id: 5
  }
  thunk_kind: "kWhile"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "w_in"
    thunk_id: 10
  }
  thunk_kind: "kWhile"
}
"""


def test_counts_each_launch_times_its_loops():
    count = ht.kernels_per_step(SEQUENCE, METADATA, ht.parse(HLO))
    outer, inner = "w_out x4", "w_out x4 > w_in x3"
    # Outside: the broadcast, the all-reduce (not its start/done), the last copy.
    assert count.by_loop[thunks.OUTSIDE] == 3
    # Outer loop: its condition 5 times; per body trip the copy inside the
    # dynamic-slice fusion, the transpose, the update slice (3 x 4 trips).
    assert count.per_trip[outer] == 4
    assert count.by_loop[outer] == 5 + 3 * 4
    # Inner loop, 12 trips per step: condition 4 per outer trip, 4 thunks per trip.
    assert count.per_trip[inner] == 5
    assert count.by_loop[inner] == 4 * 4 + 4 * 12
    assert count.total == 3 + 17 + 64 == sum(count.by_category.values())
    assert count.by_category == {
        "matmul": 24,  # the Triton gemm fusion and the cuBLAS gemm, 12 times each
        "copy/transpose": 1 + 4 + 4,  # the outside copy, the DSF copy, the transpose
        "elementwise/fusion": 1 + 5 + 4 + 16 + 12,  # broadcast, conds, DUS, add
        "collective": 1,
        "other": 12,  # the sort
    }
    assert count.unknown_trips == []
    lines = ht.format_kernels(count)
    assert lines[0].startswith("kernels launched per step: 84 ")
    assert "  w_out x4 > w_in x3: 5 per trip, 64 per step" in lines


def test_a_loop_without_metadata_is_counted_once_and_named():
    count = ht.kernels_per_step(SEQUENCE, "", ht.parse(HLO))
    assert count.unknown_trips == ["thunk 5", "thunk 10"]
    # Every loop counted as one trip (condition twice).
    assert count.total == 3 + (2 + 3) + (2 + 4)
    assert "trip count unknown (counted once): thunk 5, thunk 10" in ht.format_kernels(count)[-1]


@pytest.mark.parametrize(
    "text, match",
    [
        ("body:\n", "outside a kWhile"),
        ("001: kCopy [source | sink] kCopy\nnot a thunk\n", "not a thunk line"),
    ],
)
def test_malformed_text_names_the_line(text, match):
    with pytest.raises(ht.HloParseError, match=match):
        ht.kernels_per_step(text, "", ht.parse(HLO))


def test_categories():
    assert thunks.category("kWhile", "") is None
    assert thunks.category("kAllGatherDone", "") is None
    assert thunks.category("kReduceScatterStart", "") == "collective"
    assert thunks.category("kCustomKernel", "loop_transpose_fusion_3") == "copy/transpose"
    assert thunks.category("kKernel", "triton_gemm_dot_1") == "matmul"
    assert thunks.category("kMemset32BitValue", "") == "copy/transpose"


def test_loop_source_names_the_transform():
    assert thunks.loop_source("jit(step)/while") == "jit(step)"
    assert thunks.loop_source("jit(step)/while/body/closed_call/transpose(jvp())/while") == (
        "transpose(jvp())"
    )
    assert thunks.loop_source("jit(step)/accum_microbatch_loop[data|data=8]/while") == (
        "accum_microbatch_loop"
    )
    assert thunks.loop_source("") == ""


# A lax.cond inside the outer loop (as cuDNN's packed-or-masked attention compiles):
# a kConditional whose branches sit under label lines, one of them holding another
# conditional. One branch runs per execution: the count keeps the heaviest.
CONDITIONAL = """\
005: kWhile        [prev=004 (1) | next=020 (1)]
condition:
    006: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    030: kConditional        [prev=009 (1) | next=016 (1)]
      false_branch:
        031: kCustomKernel [source | next=032 (1)] input_scatter_fusion grid: [1, 1, 1]
        032: kCuDnn        [prev=031 (1) | sink] kCuDnn
      true_branch:
        033: kCustomKernel [source | next=034 (1)] loop_pad_fusion grid: [8, 1, 1]
        034: kConditional  [prev=033 (1) | sink]
          branch_0:
            035: kCopy [source | sink] kCopy
          branch_1:
            036: kCopy [source | next=037 (1)] kCopy
            037: kCopy [prev=036 (1) | sink] kCopy
            038: kCopy [prev=037 (1) | sink] kCopy
    016: kCustomKernel       [prev=030 (1) | sink] loop_dynamic_update_slice_fusion grid: [4, 1, 1]
"""


def test_a_conditional_counts_its_heaviest_branch():
    arms = []
    found = list(thunks.launches(CONDITIONAL, METADATA, ht.parse(HLO), arms=arms))
    inner = ((30, "true_branch"), (34, "branch_0"))
    assert arms == [
        ((30, "false_branch"),),
        ((30, "true_branch"),),
        inner,
        (*inner[:1], (34, "branch_1")),
    ]
    by_id = {x.thunk_id: x for x in found}
    assert by_id[32].branch == ((30, "false_branch"),)
    assert by_id[36].branch == ((30, "true_branch"), (34, "branch_1"))
    assert by_id[16].branch == () and by_id[16].executions == 4
    # true_branch: the pad plus branch_1's three copies (branch_0's one is dropped)
    # outweighs false_branch's two launches.
    count = ht.kernels_per_step(CONDITIONAL, METADATA, ht.parse(HLO))
    assert count.total == 5 + 4 * (1 + 3 + 1)
    assert count.conditionals == 2
    assert "  2 conditionals (lax.cond/switch), each counted by the branch launching" in "\n".join(
        ht.format_kernels(count)
    )
    assert ht.kernels_per_step(SEQUENCE, METADATA, ht.parse(HLO)).conditionals == 0
    assert count.by_category["copy/transpose"] == 4 * 3
    weights = [1.0 if x.thunk_id in (31, 32) else 0.1 for x in found]
    kept = thunks.pick_branches([x.branch for x in found], weights)
    assert {x.thunk_id for x, k in zip(found, kept, strict=True) if k} == {6, 31, 32, 16}
    # The lightest instead: true_branch (0.1 + branch_0's 0.1) under false_branch's 2.
    kept = thunks.pick_branches([x.branch for x in found], weights, pick=min)
    assert {x.thunk_id for x, k in zip(found, kept, strict=True) if k} == {6, 33, 35, 16}
    with pytest.raises(ht.HloParseError, match="true_branch: outside a kConditional"):
        ht.kernels_per_step("true_branch:\n", "", ht.parse(HLO))
