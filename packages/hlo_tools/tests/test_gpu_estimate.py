"""The GPU step-time estimate on a small program written as XLA:GPU writes it:
bytes, FLOPs, executions, categories and source lines per kernel, the roofline's
sums and grouping, the refit, the dump-file finder and `hlo-report --gpu`.

A real compile (a small model for one H200) is estimated in the trainer's aot
tier (packages/trainer/tests/test_aot_gpu_estimate.py)."""

import dataclasses

import pytest

import hlo_tools as ht
from hlo_tools import cli, gpu_estimate, gpu_kernels

HLO = """HloModule m

FileNames
1 "/work/pkg/src/model.py"

FunctionNames
1 "attn"
2 "mlp"
3 "helper"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=1}
3 {file_name_id=1 function_name_id=3 line=30 end_line=30 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=3}

%dot_comp (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %d = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%bcast_comp (p0: f32[]) -> f32[8,1024] {
  %p0 = f32[] parameter(0)
  ROOT %b = f32[8,1024]{1,0} broadcast(%p0), dimensions={}
}

%dus_comp (p0: f32[8,1024], p1: f32[1,1024], p2: s32[]) -> f32[8,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[8,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}

%exp_comp (p0: f32[8,1024], p1: s32[]) -> f32[1,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,1024}
  ROOT %e = f32[1,1024]{1,0} exponential(%s)
}

%cond (t: (s32[], f32[8,1024])) -> pred[] {
  %t = (s32[], f32[8,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t: (s32[], f32[8,1024])) -> (s32[], f32[8,1024]) {
  %t = (s32[], f32[8,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %buf = f32[8,1024]{1,0} get-tuple-element(%t), index=1
  %row = f32[1,1024]{1,0} fusion(%buf, %i), kind=kLoop, calls=%exp_comp
  %new = f32[8,1024]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%dus_comp
  %cp = f32[8,1024]{1,0} copy(%new)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,1024]{1,0}) tuple(%j, %cp)
}

ENTRY %main (a: bf16[64,128], w: bf16[128,256], x: f32[]) -> (bf16[64,256], f32[8,1024]) {
  %a = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %x = f32[] parameter(2)
  %buf = f32[8,1024]{1,0} fusion(%x), kind=kLoop, calls=%bcast_comp, metadata={stack_frame_id=1}
  %mm = bf16[64,256]{1,0} fusion(%a, %w), kind=kCustom, calls=%dot_comp, metadata={stack_frame_id=3}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,1024]{1,0}) tuple(%zero, %buf)
  %loop = (s32[], f32[8,1024]{1,0}) while(%init), condition=%cond, body=%body,backend_config={T3}
  %res = f32[8,1024]{1,0} get-tuple-element(%loop), index=1
  ROOT %r = (bf16[64,256]{1,0}, f32[8,1024]{1,0}) tuple(%mm, %res)
}
"""
HLO = HLO.replace("{T3}", '{"known_trip_count":{"n":"3"}}')

SEQUENCE = """\
001: kCustomKernel [source | next=002 (1)] loop_broadcast_fusion grid: [64, 1, 1]
002: kCustomKernel [prev=001 (1) | next=003 (1)] gemm_fusion_dot grid: [8, 1, 1]
003: kWhile        [prev=002 (1) | sink]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    005: kCustomKernel [source | next=006 (1)] loop_exponential_fusion grid: [8, 1, 1]
    006: kCustomKernel [prev=005 (1) | next=007 (1)] loop_dynamic_update_slice_fusion grid: [8]
    007: kCopy [prev=006 (1) | sink] kCopy
"""

NAMES = {1: "buf", 2: "mm", 3: "loop", 5: "row", 6: "new", 7: "cp"}
METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n'
    f"    thunk_id: {tid}\n  }}\n}}\n"
    for tid, name in NAMES.items()
)


@pytest.fixture(scope="module")
def kernels():
    return {k.instruction or k.name: k for k in ht.launched_kernels(SEQUENCE, METADATA, HLO)}


def test_bytes_flops_and_executions(kernels):
    mm = kernels["mm"]
    assert mm.flops == 2 * 64 * 256 * 128
    assert mm.bytes == (64 * 128 + 128 * 256 + 64 * 256) * 2
    assert mm.executions == 1
    assert kernels["buf"].bytes == 4 + 8 * 1024 * 4 and kernels["buf"].flops == 0
    # In place: the update read and written, the index; not the 32 KiB buffer.
    assert kernels["new"].bytes == 1024 * 4 + 4 + 1024 * 4
    # Read through a dynamic-slice: one row of the buffer, the index, the row written.
    assert kernels["row"].bytes == 1024 * 4 + 4 + 1024 * 4
    assert kernels["cp"].bytes == 2 * 8 * 1024 * 4
    assert [kernels[n].executions for n in ("row", "new", "cp")] == [3, 3, 3]
    assert kernels["loop_compare_fusion"].executions == 4  # the condition: trips + 1


def test_categories(kernels):
    got = {name: k.category for name, k in kernels.items()}
    assert got == {
        "buf": "broadcast",
        "mm": "matmul",
        "loop_compare_fusion": "other",  # no instruction named: nothing to read
        "row": "elementwise",  # the name says "exponential": the fused root decides
        "new": "dynamic-update-slice",
        "cp": "copy",
    }
    assert kernels["new"].group == "dynamic-update-slice"
    assert ht.profile_group("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NTN") == "matmul"
    assert ht.profile_group("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == (
        "attention (cuDNN)"
    )
    assert ht.profile_group("input_scatter_fusion_1") == "scatter/sort/gather"
    assert ht.profile_group("memcpy128") == "copy"
    assert ht.profile_group("loop_add_fusion") == "other"


def test_source_lines_attention_and_helpers(kernels):
    assert kernels["mm"].source == "model.py:30 (helper)"
    assert kernels["buf"].source == "model.py:10 (attn)"
    # A copy without metadata takes the line of the value it copies (none here).
    assert kernels["cp"].source == ""
    through = ht.launched_kernels(SEQUENCE, METADATA, HLO, through=("helper",))
    assert next(k for k in through if k.instruction == "mm").source == "model.py:20 (mlp)"
    attention = ht.launched_kernels(SEQUENCE, METADATA, HLO, attention_functions=("mlp",))
    cats = {k.instruction: k.category for k in attention}
    assert cats["mm"] == "attention" and cats["buf"] == "broadcast"


def _plain(**changes) -> ht.Calibration:
    base = ht.Calibration(1.0, 1.0, 1.0, 0.5, 1e-6, {}, "test")
    return dataclasses.replace(base, **changes)


def test_roofline_sums_and_groups(kernels):
    found = list(kernels.values())
    roofline = ht.Roofline(peak_flops=1e12, hbm_bandwidth=1e9, calibration=_plain())
    est = ht.estimate_step(found, roofline)
    new = found.index(kernels["new"])
    assert est.ms[new] == pytest.approx(3 * (1e-6 + kernels["new"].bytes / 1e9) * 1e3)
    mm = found.index(kernels["mm"])
    # Memory-bound at these figures: 114,688 B at 1 GB/s beats 4.2 MFLOP at 1 TFLOP/s.
    assert est.ms[mm] == pytest.approx((1e-6 + kernels["mm"].bytes / 1e9) * 1e3)
    assert est.total_ms == pytest.approx(sum(g.ms for g in est.groups))
    assert est.total_ms == pytest.approx(sum(ms for _, _, ms in est.by_category.values()))
    assert [g.ms for g in est.groups] == sorted((g.ms for g in est.groups), reverse=True)
    assert est.launches == 1 + 1 + 4 + 3 * 3
    assert est.flops == kernels["mm"].flops
    slow = ht.Roofline(1e12, 1e9, _plain(slowdown={"copy": 3.0}))
    cp = found.index(kernels["cp"])
    assert ht.estimate_step(found, slow).ms[cp] == pytest.approx(
        3 * (1e-6 + 3.0 * kernels["cp"].bytes / 1e9) * 1e3
    )
    lines = ht.format_estimate(est, top=2, model_flops_per_step=1e6, peak_flops=1e12)
    assert lines[0].startswith(f"predicted GPU step: {est.total_ms:,.1f} ms, MFU ")
    assert est.groups[0].source in lines[3]
    assert len(lines) == 5


def test_fit_recovers_factors(kernels):
    found = ht.launched_kernels(SEQUENCE, METADATA, HLO, attention_functions=("helper",))
    truth = ht.Roofline(1e12, 1e9, _plain(slowdown={"copy": 3.0, "broadcast": 0.5}))
    measured = ht.estimate_step(found, truth).by_group()
    start = ht.Roofline(1e12, 1e9, _plain(attention_efficiency=0.9))
    fitted = ht.fit_calibration(found, measured, start, source="fixture")
    assert fitted.slowdown["copy"] == pytest.approx(3.0, rel=1e-3)
    assert fitted.slowdown["broadcast"] == pytest.approx(0.5, rel=1e-3)
    assert fitted.attention_efficiency == pytest.approx(0.5, rel=1e-2)
    refit = ht.estimate_step(found, ht.Roofline(1e12, 1e9, fitted))
    assert refit.total_ms == pytest.approx(sum(measured.values()), rel=1e-2)
    with pytest.raises(ValueError, match="'memcopy' is not one of"):
        ht.fit_calibration(found, {"memcopy": 1.0}, start)


def test_fit_times_the_device_s_attention_kernels(kernels):
    # A stand-in program's attention (XLA's, in a deviceless compile) doing half the
    # FLOPs of the device's kernels (cuDNN's, with v padded): the rate is the device's
    # FLOPs over the measured time, and the stand-in's other groups fit as before.
    found = ht.launched_kernels(SEQUENCE, METADATA, HLO, attention_functions=("helper",))
    truth = ht.Roofline(1e12, 1e9, _plain(slowdown={"copy": 3.0}))
    measured = ht.estimate_step(found, truth).by_group()
    device = [dataclasses.replace(k, flops=2 * k.flops) for k in found if k.category == "attention"]
    assert device and all(k.flops for k in device)
    start = ht.Roofline(1e12, 1e9, _plain(attention_efficiency=0.9))
    stand_in = ht.fit_calibration(found, measured, start)
    fitted = ht.fit_calibration(found, measured, start, device_attention=device)
    assert fitted.attention_efficiency == pytest.approx(2 * stand_in.attention_efficiency, rel=1e-2)
    assert fitted.slowdown == stand_in.slowdown
    assert ht.fit_calibration(found, measured, start, device_attention=[]) == dataclasses.replace(
        stand_in, attention_efficiency=0.9
    )


def test_calibration_is_one_table():
    # Every category the estimate reports has its factor in the one table, or 1.
    assert set(gpu_estimate.CALIBRATION.slowdown) <= set(ht.gpu_kernels.CATEGORIES)
    assert ht.Roofline(1, 1).calibration is ht.CALIBRATION


def _write_program(directory, stem: str, hlo_name: str) -> None:
    (directory / hlo_name).write_text(HLO)
    (directory / f"{stem}.thunk_metadata.txt").write_text(METADATA)


def test_program_files_and_cli(tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    stem = "module_0001.jit_step"
    (dump / f"{stem}.thunk_sequence.txt").write_text(SEQUENCE)
    _write_program(dump, stem, f"{stem}.sm_9.0_gpu_after_optimizations.txt")
    (dump / "module_0000.jit_small.thunk_sequence.txt").write_text("")
    hlo, sequence, _ = ht.program_files(str(dump))
    assert hlo.endswith("_gpu_after_optimizations.txt") and stem in sequence
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "aot_h200-1.thunks.txt").write_text(SEQUENCE)
    _write_program(kept, "aot_h200-1", "aot_h200-1.hlo")
    assert ht.read_program(str(kept / "aot_h200-1.hlo"))[1] == SEQUENCE
    with pytest.raises(FileNotFoundError, match="nothing.hlo: not found"):
        ht.program_files(str(kept / "nothing.hlo"))
    assert cli.main(["--gpu", str(dump), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("predicted GPU step: ") and "(15 kernels;" in out
    assert cli.main(["--gpu", str(tmp_path / "missing")]) == 2


CUDNN = """HloModule c

ENTRY %main (q: bf16[2,1024,16,128], k: bf16[2,1024,16,128], v: bf16[2,1024,16,64]) -> bf16[2] {
  %q = bf16[2,1024,16,128]{3,2,1,0} parameter(0)
  %k = bf16[2,1024,16,128]{3,2,1,0} parameter(1)
  %v = bf16[2,1024,16,64]{3,2,1,0} parameter(2)
  %fwd = (bf16[2,16,1024,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %v), CALL_FWD
  %bwd = (bf16[2,1024,16,128], u8[0]{0}) custom-call(%q, %k, %v), CALL_BWD
  ROOT %z = bf16[2]{0} constant({0, 0})
}
"""
CUDNN = CUDNN.replace("CALL_FWD", 'custom_call_target="__cudnn$fmhaSoftmax"')
CUDNN = CUDNN.replace("CALL_BWD", 'custom_call_target="__cudnn$fmhaSoftmaxBackward"')


def test_cudnn_attention_custom_calls():
    # A program compiled with cuDNN (a device, or the nvidia-cudnn wheel on this host):
    # its attention calls count as the XLA attention they replace.
    sequence = "001: kCuDnn [source | next=002 (1)] fwd\n002: kCuDnn [prev=001 (1) | sink] bwd\n"
    metadata = "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
        f"    thunk_id: {i}\n  }}\n}}\n"
        for i, n in ((1, "fwd"), (2, "bwd"))
    )
    fwd, bwd = ht.launched_kernels(sequence, metadata, CUDNN)
    forward = 2 * 2 * 16 * 1024 * 1024 * (128 + 64)  # B H S T (D + Dv), two products
    assert (fwd.category, fwd.flops) == ("attention", forward)
    assert (bwd.category, bwd.flops) == ("attention", 2 * forward)
    roofline = ht.Roofline(1e15, 1e12, _plain(attention_efficiency=0.5))
    assert ht.estimate_step([fwd], roofline).total_ms == pytest.approx(
        (1e-6 + forward / 0.5e15) * 1e3
    )


MOSAIC = """HloModule g

ENTRY %main (s: s32[4], x: bf16[512,256], w: bf16[4,256,128], g: bf16[512,128]) -> bf16[2] {
  %s = s32[4]{0} parameter(0)
  %x = bf16[512,256]{1,0} parameter(1)
  %w = bf16[4,256,128]{2,1,0} parameter(2)
  %g = bf16[512,128]{1,0} parameter(3)
  %fwd = bf16[512,128]{1,0} custom-call(%s, %x, %w), MOSAIC
  %dx = bf16[512,256]{1,0} custom-call(%s, %g, %w), MOSAIC
  %dw = bf16[4,256,128]{2,1,0} custom-call(%s, %s, %x, %g), MOSAIC
  %odd = bf16[512,512]{1,0} custom-call(%x, %x), MOSAIC
  ROOT %z = bf16[2]{0} constant({0, 0})
}
""".replace("MOSAIC", 'custom_call_target="mosaic_gpu_v2"')


def test_mosaic_grouped_matmuls_count_their_flops():
    """moe_kernels' grouped GEMM (Pallas Mosaic-GPU custom calls): the forward, the
    input gradient (weights used transposed) and the weight gradient (per-group
    products of two row-ragged operands) are matmuls of 2 x 512 x 256 x 128 FLOPs
    each; a Mosaic kernel of other shapes is not called a matmul."""
    names = ("fwd", "dx", "dw", "odd")
    sequence = "".join(
        f"{i:03d}: kCustomCall [source | sink] {n}\n" for i, n in enumerate(names, 1)
    )
    metadata = "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
        f"    thunk_id: {i}\n  }}\n}}\n"
        for i, n in enumerate(names, 1)
    )
    kernels = {k.name: k for k in ht.launched_kernels(sequence, metadata, MOSAIC)}
    for name in ("fwd", "dx", "dw"):
        assert (kernels[name].category, kernels[name].flops) == ("matmul", 2 * 512 * 256 * 128)
    assert kernels["odd"].flops == 0 and kernels["odd"].category != "matmul"


def test_a_conditional_is_priced_as_its_costliest_branch(kernels):
    # The same kernel in two branches of one conditional, twice as many bytes in
    # one: only that branch is priced (which branch runs is data).
    copy = kernels["cp"]
    cheap = dataclasses.replace(copy, thunk_id=90, branch=((89, "true_branch"),))
    dear = dataclasses.replace(
        copy, thunk_id=91, bytes=2 * copy.bytes, branch=((89, "false_branch"),)
    )
    roof = ht.Roofline(1e12, 1e9, _plain())
    est = ht.estimate_step([copy, cheap, dear], roof)
    assert [k.thunk_id for k in est.kernels] == [copy.thunk_id, 91]
    alone = ht.estimate_step([copy, dataclasses.replace(dear, branch=())], roof)
    assert est.total_ms == pytest.approx(alone.total_ms)
    cheapest = ht.estimate_step([copy, cheap, dear], roof, pick=min)
    assert [k.thunk_id for k in cheapest.kernels] == [copy.thunk_id, 90]
    assert (est.conditionals, alone.conditionals) == (1, 0)
    note = "  1 conditionals (lax.cond/switch), each priced as its cheapest branch"
    assert ht.format_estimate(cheapest)[2].startswith(note)
    assert "conditionals" not in "".join(ht.format_estimate(alone))


# lax.cond(p, f, identity): one branch launches a copy, the other nothing.
IDENTITY_BRANCH = """\
001: kConditional [source | sink]
  true_branch:
    002: kCopy [source | sink] kCopy
  false_branch:
"""


def test_an_empty_branch_is_the_cheapest_a_conditional_can_take():
    found = ht.launched_kernels(IDENTITY_BRANCH, "", HLO)
    empty = [k for k in found if k.name == gpu_kernels.EMPTY_BRANCH]
    assert [k.branch for k in empty] == [((1, "false_branch"),)] and empty[0].executions == 0
    roof = ht.Roofline(1e12, 1e9, _plain())
    dear, cheap = ht.estimate_step(found, roof), ht.estimate_step(found, roof, pick=min)
    assert (dear.launches, cheap.launches) == (1, 0)
    assert cheap.total_ms == 0.0 and cheap.kernels == [] and cheap.conditionals == 1
    assert ht.kernels_per_step(IDENTITY_BRANCH, "", ht.parse(HLO)).total == 1
