# ruff: noqa: E501 -- HLO snippets are verbatim one-instruction-per-line text.
"""Async start/done pairs and the compute scheduled between them, on handwritten
scheduled HLO: sync, async with nothing between, async with a fusion between,
async inside a counted loop, TPU async collective fusions, and the CLI line."""

import json

import hlo_tools as ht
from hlo_tools.cli import main

HEAD = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%mul (x: f32[64], y: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %y = f32[64]{0} parameter(1)
  ROOT %m = f32[64]{0} multiply(%x, %y)
}
"""


def _entry(body: str) -> str:
    return (
        HEAD
        + "\nENTRY %main (p: f32[64], q: f32[64]) -> f32[64] {\n"
        + "  %p = f32[64]{0} parameter(0)\n  %q = f32[64]{0} parameter(1)\n"
        + body
        + "}\n"
    )


SYNC = _entry("  ROOT %ar = f32[64]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add\n")

NOTHING_BETWEEN = _entry(
    """  %ars = f32[64]{0} all-reduce-start(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %c = f32[] constant(1)
  %bc = f32[64]{0} bitcast(%q)
  ROOT %ard = f32[64]{0} all-reduce-done(%ars)
"""
)

FUSION_BETWEEN = _entry(
    """  %ars = f32[64]{0} all-reduce-start(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %f = f32[64]{0} fusion(%q, %q), kind=kLoop, calls=%mul
  %ard = f32[64]{0} all-reduce-done(%ars)
  ROOT %out = f32[64]{0} add(%ard, %f)
"""
)


def test_sync_collective_is_not_async():
    (r,) = ht.async_overlap(SYNC)
    assert (r.kind, r.is_async, r.overlapped, r.done, r.between) == (
        "all-reduce",
        False,
        False,
        None,
        (),
    )
    s = ht.overlap_summary([r])
    assert (s["count"], s["async"], s["overlapped"], s["share"]) == (1, 0, 0, 0.0)


def test_async_with_nothing_between():
    (r,) = ht.async_overlap(NOTHING_BETWEEN)
    # A constant and a bitcast are not compute.
    assert (r.is_async, r.start, r.done, r.between, r.overlapped) == (
        True,
        "ars",
        "ard",
        (),
        False,
    )
    assert ht.overlap_summary([r])["async_bytes_per_step"] == 64 * 4


def test_async_with_a_fusion_between():
    (r,) = ht.async_overlap(FUSION_BETWEEN)
    assert (r.is_async, r.done, r.between, r.overlapped) == (True, "ard", ("f",), True)
    s = ht.overlap_summary([r])
    assert (s["overlapped_bytes_per_step"], s["share"]) == (256, 1.0)


# A reduce-scatter wrapped in async-start/-done in a loop body that runs 6 times,
# a dot scheduled between; one all-reduce after the loop with nothing between.
LOOP = """HloModule loop, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs (x: f32[64,8]) -> f32[16,8] {
  %x = f32[64,8]{1,0} parameter(0)
  ROOT %r = f32[16,8]{1,0} reduce-scatter(%x), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[64,8], f32[16,8])) -> (s32[], f32[64,8], f32[16,8]) {
  %t = (s32[], f32[64,8]{1,0}, f32[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %g = f32[64,8]{1,0} get-tuple-element(%t), index=1
  %as = ((f32[64,8]{1,0}), f32[16,8]{1,0}, u32[]) async-start(%g), calls=%rs
  %au = ((f32[64,8]{1,0}), f32[16,8]{1,0}, u32[]) async-update(%as), calls=%rs
  %w = f32[8,8]{1,0} dot(%g, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %ad = f32[16,8]{1,0} async-done(%au), calls=%rs
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], f32[64,8]{1,0}, f32[16,8]{1,0}) tuple(%n, %g, %ad)
}

%cond (t: (s32[], f32[64,8], f32[16,8])) -> pred[] {
  %t = (s32[], f32[64,8]{1,0}, f32[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %lim = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}

ENTRY %main (g: f32[64,8], h: f32[16,8]) -> f32[64,8] {
  %g = f32[64,8]{1,0} parameter(0)
  %h = f32[16,8]{1,0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[64,8]{1,0}, f32[16,8]{1,0}) tuple(%z, %g, %h)
  %loop = (s32[], f32[64,8]{1,0}, f32[16,8]{1,0}) while(%init), condition=%cond, body=%body
  %x = f32[64,8]{1,0} get-tuple-element(%loop), index=1
  %ars = f32[64,8]{1,0} all-reduce-start(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %ard = f32[64,8]{1,0} all-reduce-done(%ars)
}
"""


def test_async_inside_a_counted_loop():
    by_kind = {r.kind: r for r in ht.async_overlap(LOOP)}
    rs, ar = by_kind["reduce-scatter"], by_kind["all-reduce"]
    # The wrapped reduce-scatter is read where its async-start is scheduled:
    # the loop body, through async-update, with the dot between.
    assert (rs.is_async, rs.computation, rs.start, rs.done, rs.between) == (
        True,
        "body",
        "as",
        "ad",
        ("w",),
    )
    assert rs.collective.multiplier == 6 and rs.bytes_per_step == 6 * 16 * 8 * 4
    assert (ar.is_async, ar.overlapped, ar.bytes_per_step) == (True, False, 64 * 8 * 4)
    report = ht.overlap_report(LOOP)
    s = report["gradient_reductions"]
    assert (s["count"], s["async"], s["overlapped"]) == (2, 2, 1)
    assert s["overlapped_bytes_per_step"] == 3072 and s["bytes_per_step"] == 3072 + 2048
    assert s["share"] == 3072 / 5120 and s["exact"]
    # On the wire (n=4): the reduce-scatter sends 3 of its 512-byte shards per
    # execution, the all-reduce 2 x 3/4 of its 2048 bytes.
    assert ht.wire_bytes(rs.collective) == 3 * 512 and ht.wire_bytes(ar.collective) == 3072
    assert s["wire_bytes_per_step"] == 6 * 1536 + 3072
    assert s["wire_share"] == 6 * 1536 / (6 * 1536 + 3072)


# TPU async collective fusion: the all-gather is repeated in the continuation
# (beside a convolution) and in the done; the done reaches the start through
# the continuation's tuple. A sync all-reduce sits between: not compute.
TPU = """HloModule tpu, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%start_comp (p0: f32[16,128]) -> (f32[16,128], f32[128,128], u32[]) {
  %p0 = f32[16,128]{1,0:T(8,128)} parameter(0)
  %ag.0 = f32[128,128]{1,0:T(8,128)} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"-1","flag_end":"-1"}}
  ROOT %cc = (f32[16,128]{1,0:T(8,128)}, f32[128,128]{1,0:T(8,128)}, u32[]) custom-call(%ag.0), custom_call_target="AsyncCollectiveStart"
}

%cont_comp (c0: f32[16,128], c1: f32[128,128], c2: u32[], c3: f32[128,128]) -> (f32[128,128], f32[16,128], f32[128,128], u32[]) {
  %c0 = f32[16,128]{1,0:T(8,128)} parameter(0)
  %c1 = f32[128,128]{1,0:T(8,128)} parameter(1)
  %c2 = u32[] parameter(2)
  %c3 = f32[128,128]{1,0:T(8,128)} parameter(3)
  %conv = f32[128,128]{1,0:T(8,128)} convolution(%c3, %c3), dim_labels=bf_io->bf
  %ag.1 = f32[128,128]{1,0:T(8,128)} all-gather(%c0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  ROOT %t = (f32[128,128]{1,0:T(8,128)}, f32[16,128]{1,0:T(8,128)}, f32[128,128]{1,0:T(8,128)}, u32[]) tuple(%conv, %c0, %ag.1, %c2)
}

%done_comp (d0: f32[16,128], d1: f32[128,128], d2: u32[]) -> f32[128,128] {
  %d0 = f32[16,128]{1,0:T(8,128)} parameter(0)
  %d1 = f32[128,128]{1,0:T(8,128)} parameter(1)
  %d2 = u32[] parameter(2)
  %ag.2 = f32[128,128]{1,0:T(8,128)} all-gather(%d0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  ROOT %cc = f32[128,128]{1,0:T(8,128)} custom-call(%d0, %d1, %ag.2, %d2), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (x: f32[16,128], w: f32[128,128]) -> (f32[128,128], f32[128,128], f32[128,128]) {
  %x = f32[16,128]{1,0:T(8,128)} parameter(0)
  %w = f32[128,128]{1,0:T(8,128)} parameter(1)
  %acs = (f32[16,128]{1,0:T(8,128)}, f32[128,128]{1,0:T(8,128)}, u32[]) fusion(%x), kind=kCustom, calls=%start_comp
  %s0 = f32[16,128]{1,0:T(8,128)} get-tuple-element(%acs), index=0
  %s1 = f32[128,128]{1,0:T(8,128)} get-tuple-element(%acs), index=1
  %s2 = u32[] get-tuple-element(%acs), index=2
  %ar = f32[128,128]{1,0:T(8,128)} all-reduce(%w), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %cont = (f32[128,128]{1,0:T(8,128)}, f32[16,128]{1,0:T(8,128)}, f32[128,128]{1,0:T(8,128)}, u32[]) fusion(%s0, %s1, %s2, %w), kind=kOutput, calls=%cont_comp
  %y = f32[128,128]{1,0:T(8,128)} get-tuple-element(%cont), index=0
  %k0 = f32[16,128]{1,0:T(8,128)} get-tuple-element(%cont), index=1
  %k1 = f32[128,128]{1,0:T(8,128)} get-tuple-element(%cont), index=2
  %k2 = u32[] get-tuple-element(%cont), index=3
  %acd = f32[128,128]{1,0:T(8,128)} fusion(%k0, %k1, %k2), kind=kCustom, calls=%done_comp
  ROOT %out = (f32[128,128]{1,0:T(8,128)}, f32[128,128]{1,0:T(8,128)}, f32[128,128]{1,0:T(8,128)}) tuple(%acd, %y, %ar)
}
"""


def test_tpu_async_collective_fusion_counted_once_and_overlapped():
    # The repeats in the continuation and the done are one all-gather, not three.
    assert sorted(c.name for c in ht.collectives(TPU)) == ["ag.0", "ar"]
    by_kind = {r.kind: r for r in ht.async_overlap(TPU)}
    ag, ar = by_kind["all-gather"], by_kind["all-reduce"]
    assert (ag.is_async, ag.start, ag.done, ag.between) == (True, "acs", "acd", ("cont",))
    assert ag.bytes == 128 * 128 * 4 and not ar.is_async
    report = ht.overlap_report(TPU)
    assert report["gradient_reductions"]["share"] == 0.0
    assert report["all"]["share"] == 0.5  # two 64 KiB collectives, the all-gather hidden


def test_async_pairs_of_the_other_spellings():
    # all-gather-start, collective-permute-start and async-start/-done, as GPU prints them.
    text = _entry(
        """  %ags = (f32[64]{0}, f32[256]{0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1},{1,0}}
  %f = f32[64]{0} fusion(%p, %q), kind=kLoop, calls=%mul
  %agd = f32[256]{0} all-gather-done(%ags)
  %cpd = f32[64]{0} collective-permute-done(%cps)
  ROOT %s = f32[64]{0} slice(%agd), slice={[0:64]}
"""
    )
    pairs = {key[1]: pair.done for key, pair in ht.async_pairs(ht.parse(text)).items()}
    assert pairs == {"ags": "agd", "cps": "cpd"}
    assert all(r.overlapped for r in ht.async_overlap(text))


def test_start_without_its_done_runs_to_the_end():
    # A done outside the start's computation (pipelined through a loop carry):
    # the compute after the start, to the end of the computation, is what overlaps.
    text = _entry(
        """  %ars = f32[64]{0} all-reduce-start(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %f = f32[64]{0} fusion(%q, %q), kind=kLoop, calls=%mul
  ROOT %t = (f32[64]{0}, f32[64]{0}) tuple(%ars, %f)
"""
    ).replace("-> f32[64] {\n  %p", "-> (f32[64], f32[64]) {\n  %p")
    (r,) = ht.async_overlap(text)
    assert (r.is_async, r.done, r.between) == (True, None, ("f",))


def test_cli_prints_the_overlap_line_before_the_verdict(tmp_path, capsys):
    path = tmp_path / "loop.hlo"
    path.write_text(LOOP)
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == (
        "overlapped (async, compute between start and done): gradient reductions "
        "60.0% of 5.0 KiB/step (1 of 2, 2 async); all collectives 60.0% of 5.0 KiB/step "
        "(1 of 2, 2 async)"
    )
    assert lines[-1].startswith("FAIL")
    assert main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["overlap"]["gradient_reductions"]["overlapped"] == 1
    assert [c["compute_between"] for c in data["overlap"]["collectives"]] == [1, 0]
