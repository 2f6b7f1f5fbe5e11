# ruff: noqa: E501 -- HLO snippets are verbatim one-instruction-per-line text.
"""Handcrafted HLO covering what the example programs do not: async pairs, iota and
mesh replica groups, tuple results, loops with and without trip counts,
conditionals, TPU collective fusions, JSON backend configs."""

import pytest

import hlo_tools as ht

ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

ASYNC = (
    "HloModule async, num_partitions=8\n"
    + ADD
    + """
%wrapped (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %ar = f32[64]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (x: f32[128], y: bf16[16,8]) -> f32[128] {
  %x = f32[128]{0} parameter(0)
  %y = bf16[16,8]{1,0} parameter(1)
  %ars = f32[128]{0} all-reduce-start(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ard = f32[128]{0} all-reduce-done(%ars)
  %ags = (bf16[16,8]{1,0}, bf16[128,8]{1,0}) all-gather-start(%y), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = bf16[128,8]{1,0} all-gather-done(%ags)
  %cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[128]{0} collective-permute-done(%cps)
  %sl = f32[64]{0} slice(%cpd), slice={[0:64]}
  %as = ((f32[64]{0}), f32[64]{0}, u32[]) async-start(%sl), calls=%wrapped
  %ad = f32[64]{0} async-done(%as), calls=%wrapped
  ROOT %out = f32[128]{0} concatenate(%ad, %ad), dimensions={0}
}
"""
)


def test_async_pairs_count_the_start_once():
    records = {c.opcode: c for c in ht.collectives(ASYNC)}
    # Independent count: 3 -start ops + 1 all-reduce inside the async wrapper.
    assert sorted(records) == [
        "all-gather-start",
        "all-reduce",
        "all-reduce-start",
        "collective-permute-start",
    ]
    ar = records["all-reduce-start"]
    assert (ar.kind, ar.bytes, ar.group_size, ar.channel_id) == ("all-reduce", 128 * 4, 4, 1)
    ag = records["all-gather-start"]
    # The output half of the (operand, output) tuple: 128*8 bf16.
    assert (ag.kind, ag.shape, ag.bytes, ag.group_size) == ("all-gather", (128, 8), 2048, 8)
    cp = records["collective-permute-start"]
    assert (cp.kind, cp.bytes, cp.group_size) == ("collective-permute", 512, None)
    wrapped = records["all-reduce"]
    assert wrapped.via == ("as",) and wrapped.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    t = ht.traffic(ASYNC)
    assert t["outside"]["all-reduce"]["count"] == 2
    assert t["bytes_per_step"] == 512 + 2048 + 512 + 256


GPU_ALL_TO_ALL = """HloModule a2a, num_partitions=2

ENTRY %main (x: bf16[2,4,8]) -> bf16[2,4,8] {
  %x = bf16[2,4,8]{2,1,0} parameter(0)
  %s = ((bf16[2,4,8]{2,1,0}), bf16[2,4,8]{2,1,0}) all-to-all-start(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  ROOT %d = bf16[2,4,8]{2,1,0} all-to-all-done(%s)
}
"""


def test_gpu_all_to_all_start_counts_its_output_once():
    # GPU prints all-to-all-start as ((operands), output): the payload is the output.
    (c,) = ht.collectives(GPU_ALL_TO_ALL)
    assert (c.kind, c.shape, c.dtype, c.bytes) == ("all-to-all", (2, 4, 8), "bf16", 2 * 4 * 8 * 2)


def _loops(body_trip: str, outer_trip: str, extra: str = "") -> str:
    return (
        "HloModule loops, num_partitions=4\n"
        + ADD
        + f"""
%inner_body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {{
  %p = (s32[], f32[8,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8,4]{{1,0}} get-tuple-element(%p), index=1
  %r = f32[8,4]{{1,0}} all-reduce(%v), replica_groups={{}}, to_apply=%add, metadata={{op_name="jit(f)/inner/psum" source_file="a.py"}}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,4]{{1,0}}) tuple(%n, %r)
}}

%inner_cond (p: (s32[], f32[8,4])) -> pred[] {{
  %p = (s32[], f32[8,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %lim = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}}

%outer_body (q: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {{
  %q = (s32[], f32[8,4]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %w = f32[8,4]{{1,0}} get-tuple-element(%q), index=1
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,4]{{1,0}}) tuple(%zero, %w)
  %loop = (s32[], f32[8,4]{{1,0}}) while(%init), condition=%inner_cond, body=%inner_body{body_trip}
  %res = f32[8,4]{{1,0}} get-tuple-element(%loop), index=1
  %small = f32[2]{{0}} slice(%res), slice={{[0:1], [0:2]}}
  %tiny = f32[2]{{0}} all-reduce(%small), replica_groups={{{{0,1,2,3}}}}, to_apply=%add
  %one = s32[] constant(1)
  %k = s32[] add(%j, %one)
  ROOT %t = (s32[], f32[8,4]{{1,0}}) tuple(%k, %res)
}}

%outer_cond (q: (s32[], f32[8,4])) -> pred[] {{
  %q = (s32[], f32[8,4]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %arg = s32[] parameter(1)
  ROOT %lt = pred[] compare(%j, %j), direction=LT
}}

ENTRY %main (x: f32[8,4]) -> f32[8,4] {{
  %x = f32[8,4]{{1,0}} parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8,4]{{1,0}}) tuple(%c0, %x)
  %loop = (s32[], f32[8,4]{{1,0}}) while(%init), condition=%outer_cond, body=%outer_body{outer_trip}
  %g = f32[8,4]{{1,0}} get-tuple-element(%loop), index=1
  {extra}ROOT %out = f32[8,4]{{1,0}} all-reduce(%g), replica_groups=[1,4]<=[4], to_apply=%add
}}
"""
    )


KNOWN = ', backend_config={"known_trip_count":{"n":"%d"},"note":"a \\"quoted\\" {brace}"}'


def test_nested_whiles_with_known_trip_counts():
    text = _loops(KNOWN % 5, KNOWN % 7)
    by_name = {c.name: c for c in ht.collectives(text)}
    r, tiny, out = by_name["r"], by_name["tiny"], by_name["out"]
    assert [lp.trip_count for lp in r.loops] == [7, 5]
    assert r.multiplier == 35 and r.op_name == "jit(f)/inner/psum"
    assert r.group_size == 4  # '{}' means every device of num_partitions=4
    assert tiny.multiplier == 7 and out.multiplier == 1
    t = ht.traffic(text)
    assert t["in_loop"]["all-reduce"]["bytes_per_step"] == 35 * 8 * 4 * 4 + 7 * 2 * 4
    assert t["outside"]["all-reduce"]["bytes_per_step"] == 8 * 4 * 4
    # tiny (2 elements) is allowed in the loop; r (32 elements) is not.
    with pytest.raises(AssertionError) as err:
        ht.assert_reduced_once_per_step(text)
    assert "jit(f)/inner/psum" in str(err.value) and "%tiny" not in str(err.value)
    assert "%loop(x7) > %loop(x5)" in str(err.value)
    assert [c.name for c in ht.in_loop_reductions(text)] == ["r"]
    assert [c.name for c in ht.in_loop_reductions(text, max_in_loop_elements=1)] == ["r", "tiny"]


def test_trip_counts_inferred_or_unknown():
    # No backend_config: the inner loop (i=0; i<5; i+=1) is inferred, the outer
    # one (condition j < j) is not a counted loop, so it stays unknown.
    text = _loops("", "")
    r = next(c for c in ht.collectives(text) if c.name == "r")
    assert [(lp.trip_count, lp.trip_count_source) for lp in r.loops] == [
        (None, None),
        (5, "inferred"),
    ]
    assert r.multiplier is None and r.bytes_per_step is None
    t = ht.traffic(text)
    assert not t["exact"]
    assert t["in_loop"]["all-reduce"]["unknown_trip_count"] == 2
    assert (
        "x?/step"
        in pytest.raises(AssertionError, ht.assert_reduced_once_per_step, text).value.args[0]
    )


def test_split_by_entry_loop_on_snippet():
    inside, outside = ht.split_by_entry_loop(_loops(KNOWN % 5, KNOWN % 7))
    assert sorted(ht.cross_replica_all_reduce_sizes(inside)) == [2, 32]
    assert ht.cross_replica_all_reduce_sizes(outside) == [32]
    # The reducer %add is called from inside the loops, so its lines are inside.
    assert any("%s = f32[] add" in ln for ln in inside)


def test_cross_replica_sizes_skip_single_device_groups():
    lines = [
        "%a = f32[10]{0} all-reduce(%x), replica_groups={{0},{1}}, to_apply=%add",
        "%b = (f32[3]{0}, f32[4]{0}) all-reduce(%x, %y), replica_groups={{0,1}}, to_apply=%add",
        "%c = f32[6]{0} all-reduce-start(%x), replica_groups={}, to_apply=%add",
        "%d = f32[6]{0} all-reduce-done(%c)",
        "%e = f32[6]{0} reduce-scatter(%x), replica_groups={{0,1}}, dimensions={0}, to_apply=%add",
        "}",
    ]
    assert ht.cross_replica_all_reduce_sizes(lines) == [7, 6]


CONDITIONAL = (
    "HloModule cond, replica_count=2\n"
    + ADD
    + """
%then (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %r = f32[4]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
}

%else (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %g = f32[4]{0} all-to-all(%a), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (p: pred[], x: f32[4]) -> f32[4] {
  %p = pred[] parameter(0)
  %x = f32[4]{0} parameter(1)
  ROOT %c = f32[4]{0} conditional(%p, %x, %x), true_computation=%then, false_computation=%else
}
"""
)


def test_conditional_branches_are_each_counted_and_marked():
    records = ht.collectives(CONDITIONAL)
    assert sorted((c.kind, c.conditional, c.via) for c in records) == [
        ("all-reduce", True, ("c",)),
        ("all-to-all", True, ("c",)),
    ]


TPU_FUSION = """HloModule tpu, num_partitions=8

%region_6.8 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[]{:T(128)} parameter(0)
  %b = f32[]{:T(128)} parameter(1)
  ROOT %s = f32[]{:T(128)} add(%a, %b)
}

%all-reduce-scatter (input: f32[3,128,128]) -> f32[3,16,128] {
  %input = f32[3,128,128]{2,1,0:T(8,128)} parameter(0)
  %all-reduce = f32[3,128,128]{2,1,0:T(8,128)} all-reduce(%input), channel_id=1, replica_groups=[1,8]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%region_6.8, backend_config={"flag_configs":[],"barrier_config":{"barrier_type":"CUSTOM","id":"0"}}
  %z = s32[]{:T(128)} constant(0)
  ROOT %ds = f32[3,16,128]{2,1,0:T(8,128)} dynamic-slice(%all-reduce, %z, %z, %z), dynamic_slice_sizes={3,16,128}
}

ENTRY %main (g: bf16[3,128,128]) -> f32[3,16,128] {
  %g = bf16[3,128,128]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %c = f32[3,128,128]{2,1,0:T(8,128)} convert(%g)
  ROOT %fusion = f32[3,16,128]{2,1,0:T(8,128)} fusion(%c), kind=kCustom, calls=%all-reduce-scatter, metadata={op_name="jit(step)/reshard" stack_frame_id=3}
}
"""


def test_tpu_collective_inside_a_custom_fusion():
    (c,) = ht.collectives(TPU_FUSION)
    assert (c.kind, c.computation, c.via) == ("all-reduce", "all-reduce-scatter", ("fusion",))
    # The fusion's op_name stands in for the bare all-reduce's missing one.
    assert c.op_name == "jit(step)/reshard"
    assert c.replica_groups == ((0, 2, 4, 6, 1, 3, 5, 7),)
    assert c.bytes == 3 * 128 * 128 * 4
    assert ht.assert_reduced_once_per_step(TPU_FUSION)[0] is not None
    module = ht.parse(TPU_FUSION)
    g = module.entry.by_name["g"]
    assert g.type.layout == "2,1,0:T(8,128)(2,1)S(1)" and g.type.bytes == 3 * 128 * 128 * 2


def test_tuple_results_and_mesh_groups():
    text = (
        "HloModule t, num_partitions=4\n"
        + ADD
        + """
ENTRY %main (x: f32[4], y: bf16[2,3]) -> (f32[4], bf16[2,3]) {
  %x = f32[4]{0} parameter(0)
  %y = bf16[2,3]{1,0} parameter(1)
  ROOT %ar = (f32[4]{0}, /*index=1*/bf16[2,3]{1,0}) all-reduce(%x, /*index=1*/%y), replica_groups=mesh['a'=2,'b'=2] {'a'}, to_apply=%add
}
"""
    )
    (c,) = ht.collectives(text)
    assert (
        c.shape == ((4,), (2, 3)) and c.dtype == "f32,bf16" and c.type_str == "(f32[4], bf16[2,3])"
    )
    assert (c.elements, c.bytes) == (4 + 6, 16 + 12)
    # Devices laid out [a=2, b=2] row-major; grouping over 'a' pairs 0 with 2, 1 with 3.
    assert c.replica_groups == ((0, 2), (1, 3)) and c.group_size == 2


SPARSECORE = (
    "HloModule sc, num_partitions=8\n"
    + ADD
    + """
%called_computation.6 (param_0: s32[32]) -> s32[32] {
  %param_0 = s32[32]{0:T(128)} parameter(0)
  ROOT %copy.1 = s32[32]{0:T(128)} copy(%param_0)
}, execution_thread="sparsecore"

ENTRY %main (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  ROOT %ar = f32[64]{0} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add
}
"""
)


def test_sparsecore_computation_closed_with_attributes():
    # v5p dumps close SparseCore computations with `}, execution_thread="sparsecore"`.
    module = ht.parse(SPARSECORE)
    assert "called_computation.6" in module.computations
    assert [c.elements for c in ht.collectives(module)] == [64]


# A Pallas kernel on TPU: its frontend attributes hold kernel metadata with line
# breaks, so one instruction spans three lines (as in a splash attention program).
PALLAS = (
    "HloModule pallas, num_partitions=8\n"
    + ADD
    + """
ENTRY %main (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %k = f32[64]{0} custom-call(%x), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"mask\\": \\"[(\\"}"
}}, metadata={op_name="jit(step)/splash"}
  ROOT %ar = f32[64]{0} all-reduce(%k), replica_groups=[1,8]<=[8], to_apply=%add
}
"""
)


def test_an_instruction_continued_over_lines_is_one_instruction():
    module = ht.parse(PALLAS)
    main = module.computations["main"]
    assert [i.name for i in main.instructions] == ["x", "k", "ar"]
    assert main.instructions[1].opcode == "custom-call"
    assert [c.elements for c in ht.collectives(module)] == [64]
    # Left open, it swallows the computation's closing brace: still an error.
    with pytest.raises(ht.HloParseError, match="unbalanced brackets|not closed"):
        ht.parse(PALLAS.replace("}}, metadata", "}, metadata"))


def test_spans_mesh_axis_reads_the_groups():
    records = {c.opcode: c for c in ht.collectives(ASYNC)}
    mesh = {"data": 2, "fsdp": 4}  # row-major: device d has data d // 4, fsdp d % 4
    # {{0,1,2,3},{4,5,6,7}}: each group is one data index, every fsdp index.
    start = records["all-reduce-start"]
    assert ht.spans_mesh_axis(start, mesh, "fsdp")
    assert not ht.spans_mesh_axis(start, mesh, "data")
    # [2,4]<=[8] is the same grouping, from the iota form.
    inner = records["all-reduce"]
    assert inner.replica_groups == start.replica_groups
    # Transposed mesh order: now the groups run across 'data' (size 4) instead.
    swapped = {"fsdp": 2, "data": 4}
    assert ht.spans_mesh_axis(start, swapped, "data")
    assert not ht.spans_mesh_axis(start, swapped, "fsdp")
    # [1,8]<=[8]: one group of all devices spans both axes.
    gather = records["all-gather-start"]
    assert ht.spans_mesh_axis(gather, mesh, "data") and ht.spans_mesh_axis(gather, mesh, "fsdp")
    assert [ht.axis_index(d, mesh, "fsdp") for d in range(8)] == [0, 1, 2, 3] * 2
    with pytest.raises(KeyError, match="'tensor'"):
        ht.axis_index(0, mesh, "tensor")


def _fsdp_loops() -> str:
    """`_loops` with the big in-loop all-reduce over device pairs {0,1},{2,3}: on a
    data=2 x fsdp=2 mesh that is a reduction over 'fsdp' only (FSDP's own)."""
    text = _loops(KNOWN % 5, KNOWN % 7)
    return text.replace("%r = f32[8,4]{1,0} all-reduce(%v), replica_groups={}",
                        "%r = f32[8,4]{1,0} all-reduce(%v), replica_groups={{0,1},{2,3}}")  # fmt: skip


def test_verdict_over_mesh_axes():
    text = _fsdp_loops()
    mesh = {"data": 2, "fsdp": 2}
    assert ht.parse(text).num_devices == 4 and "replica_groups={{0,1},{2,3}}" in text
    plain = ht.verdict(ht.parse(text))
    assert plain["status"] == "FAIL"  # without the mesh every in-loop reduction counts
    judged = ht.verdict(ht.parse(text), mesh_shape=mesh, over=["data"])
    assert judged["status"] == "OK" and judged["allowed_in_loop"] == 1
    assert "over fsdp only, allowed" in judged["message"]
    strict = ht.verdict(ht.parse(text), mesh_shape=mesh, over=["fsdp"])
    assert strict["status"] == "FAIL" and "over fsdp inside loops" in strict["message"]
    # The caller knows this one carries activations (accum's verdict reads it): allowed.
    module = ht.parse(text)
    known = [c for c in ht.in_loop_reductions(module) if c.name == "r"]
    told = ht.verdict(module, mesh_shape=mesh, over=["fsdp"], activations=known)
    assert told["status"] == "OK" and "1 of them carrying activations" in told["message"]
    with pytest.raises(ValueError, match="needs mesh_shape"):
        ht.verdict(ht.parse(text), over=["data"])
    with pytest.raises(ValueError, match=r"\['tensor'\]"):
        ht.verdict(ht.parse(text), mesh_shape=mesh, over=["tensor"])


def test_cli_mesh_and_over(tmp_path, capsys):
    from hlo_tools.cli import main

    path = tmp_path / "fsdp.hlo"
    path.write_text(_fsdp_loops())
    assert main([str(path), "--check"]) == 1
    assert main([str(path), "--mesh", "data=2,fsdp=2", "--over", "data", "--check"]) == 0
    assert "OK: no reduction > 8 elements over data" in capsys.readouterr().out
    assert main([str(path), "--mesh", "data=3,fsdp=2", "--over", "data"]) == 2
    assert "has 6 devices; the program has 4" in capsys.readouterr().err
    assert main([str(path), "--mesh", "data=2,fsdp", "--over", "data"]) == 2
    assert "--mesh entry 'fsdp'" in capsys.readouterr().err
    assert main([str(path), "--over", "data"]) == 2


def test_the_same_text_parses_to_the_same_module_while_it_is_kept(monkeypatch):
    from hlo_tools import parser

    copy = "".join(list(ASYNC))  # an equal text, another str object
    assert copy is not ASYNC and ht.parse(copy) is ht.parse(ASYNC)
    other = ASYNC.replace("HloModule async", "HloModule other")
    assert ht.parse(other) is not ht.parse(ASYNC) and ht.parse(other).name == "other"
    # Kept by the texts' total length: room for one of them drops the older one.
    monkeypatch.setattr(parser, "_CACHE_CHARS", len(ASYNC))
    one, two = (ASYNC.replace("HloModule async", f"HloModule {n}") for n in ("one", "two"))
    first = ht.parse(one)
    assert ht.parse(one) is first
    ht.parse(two)
    assert ht.parse(one) is not first
    # The newest text is kept even where it alone is over the bound.
    monkeypatch.setattr(parser, "_CACHE_CHARS", 10)
    big = ht.parse(two)
    assert ht.parse(two) is big and len(parser._CACHE) == 1
    # Errors are raised each time, never kept.
    for _ in range(2):
        with pytest.raises(ht.HloParseError):
            ht.parse("ENTRY %main {")
