# ruff: noqa: E501 -- HLO snippets are verbatim one-instruction-per-line text.
"""Cross-slice vs in-slice bytes: a per-slice TPU program (megascale DCN sends) and
a single program over emulated slices (replica groups across device-id blocks)."""

import hlo_tools as ht

ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

# One slice's program (8 devices): an in-slice all-reduce and a megascale all-reduce
# across slices as a send/recv pair (only the send counts).
PER_SLICE = (
    "HloModule per_slice, num_partitions=8\n"
    + ADD
    + """
ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  %ar = f32[256]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %aa = token[] after-all()
  %send = (f32[256]{0}, u32[], token[]) send(%ar, %aa), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[256]{0}, u32[], token[]) recv(%aa), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %out = f32[256]{0} get-tuple-element(%recv), index=0
}
"""
)

# One program over 8 devices as 2 emulated slices of 4 (ids 0-3 and 4-7).
EMULATED = (
    "HloModule emulated, num_partitions=8\n"
    + ADD
    + """
ENTRY %main (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %inside = f32[64]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %across = f32[64]{0} all-reduce(%inside), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
}
"""
)


def test_megascale_send_is_one_cross_slice_all_reduce():
    records = ht.collectives(PER_SLICE)
    dcn = [c for c in records if c.cross_slice]
    assert [(c.kind, c.bytes) for c in dcn] == [("all-reduce", 1024)]
    split = ht.slice_traffic(PER_SLICE, 2)
    assert split["cross_slice"] == {"in_loop": 0, "outside": 1024}
    assert split["in_slice"] == {"in_loop": 0, "outside": 1024}


def test_emulated_slices_split_by_replica_groups():
    split = ht.slice_traffic(EMULATED, 2)
    assert split["cross_slice"]["outside"] == 256 and split["in_slice"]["outside"] == 256
    assert ht.slice_traffic(EMULATED, 1)["cross_slice"]["outside"] == 0
    assert "cross-slice 256 B/step" in ht.format_slice_traffic(split)


def test_slice_of_places_devices_whose_slices_are_no_id_blocks():
    # Slices {0, 1, 4, 5} and {2, 3, 6, 7} (an inner mesh axis crossing slices): the
    # first all-reduce now crosses them, the second stays inside each.
    where = [0, 0, 1, 1, 0, 0, 1, 1]
    first, second = ht.collectives(EMULATED)
    assert ht.crosses_slices(first, 8, 2, where) and not ht.crosses_slices(second, 8, 2, where)
    split = ht.slice_traffic(EMULATED, 2, slice_of=where)
    assert split["cross_slice"]["outside"] == 256 and split["in_slice"]["outside"] == 256
    assert ht.split_by_slice([first, second], 2, 8, where) == ([first], [second])


def test_cli_prints_the_split(tmp_path, capsys):
    from hlo_tools.cli import main

    path = tmp_path / "m.hlo"
    path.write_text(EMULATED)
    assert main([str(path), "--slices", "2"]) == 0
    assert "2 slices: cross-slice 256 B/step (0 B in loops)" in capsys.readouterr().out
    assert main([str(path), "--slices", "3"]) == 2


def test_cli_takes_the_whole_mesh_for_one_slices_program(tmp_path, capsys):
    from hlo_tools.cli import main

    path = tmp_path / "per_slice.hlo"
    path.write_text(PER_SLICE)
    # 16 devices in the mesh, 8 in the program: it is one of 2 slices.
    assert (
        main([str(path), "--mesh", "dcn_data=2,data=8", "--over", "dcn_data", "--slices", "2"]) == 0
    )
    out = capsys.readouterr().out
    assert "cross-slice 1.0 KiB/step (0 B in loops)" in out
    assert main([str(path), "--mesh", "dcn_data=2,data=8"]) == 2  # without --slices: 16 != 8
