"""Small units: types, replica groups, instruction attributes."""

import pytest

import hlo_tools as ht
from hlo_tools.replica_groups import parse_replica_groups
from hlo_tools.shapes import parse_type


@pytest.mark.parametrize(
    "text,groups",
    [
        ("{}", None),
        ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("[4,2]<=[2,2,2]T(2,1,0)", ((0, 4), (2, 6), (1, 5), (3, 7))),
        ("mesh['x'=2,'y'=4] {'y'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['x'=2,'y'=4] {'x'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ],
)
def test_replica_groups(text, groups):
    assert parse_replica_groups(text) == groups


def test_mesh_replica_groups_with_device_order():
    # As XLA prints it for a (data=4, fsdp=2) mesh: `mesh[...], device_ids=(...) {...}`.
    line = (
        "  %ag = f32[64,40]{1,0} all-gather(%p), channel_id=8, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], "
        "device_ids=([4,2]T(1,0)) {'axis_0'}, dimensions={0}, use_global_device_ids=true"
    )
    # Device at mesh position k: iota(8).reshape(4,2).T.flatten() = 0,2,4,6,1,3,5,7;
    # groups vary axis_0 (stride 4 over positions): (pos 0, 4), (1, 5), ...
    instruction = ht.parse_instruction(line, 7)
    assert instruction.replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert parse_replica_groups("mesh['a'=2,'b'=2]", 1, "(3,2,1,0) {'b'}") == ((3, 2), (1, 0))
    for bad in ("([4,2]T(0,0)) {'a'}", "(x) {'a'}", "[4,2] {'a'}", "(0,1) {'a'}"):
        with pytest.raises(ht.HloParseError):
            parse_replica_groups("mesh['a'=2,'b'=2]", 1, bad)


@pytest.mark.parametrize(
    "bad", ["{{0,1},{x}}", "[2,4]<=[7]", "[2,4]<=[4,2]T(0,0)", "mesh[] {'q'}", "?"]
)
def test_bad_replica_groups(bad):
    with pytest.raises(ht.HloParseError):
        parse_replica_groups(bad, 3)


def test_types():
    text = "(s32[]{:T(128)}, (pred[], bf16[8,128]{1,0:T(8,128)(2,1)S(1)}), f32[<=4,3]) x"
    t, end = parse_type(text)
    assert str(t) == "(s32[], (pred[], bf16[8,128]), f32[4,3])" and text[end:] == " x"
    assert [a.bytes for a in t.arrays()] == [4, 1, 8 * 128 * 2, 48]
    assert parse_type("s4[3]")[0].bytes == 2 and parse_type("f8e4m3fn[10]")[0].bytes == 10
    with pytest.raises(ht.HloParseError):
        parse_type("q32[4]")


def test_instruction_attributes():
    i = ht.parse_instruction(
        "%w = (s32[], f32[2]{0}) while(%t), condition=%c, body=%b, "
        'metadata={op_name="jit(f)/while" stack_frame_id=2}, '
        'backend_config={"known_trip_count":{"n":"12"},"s":"}{\\"}"}',
        7,
    )
    assert (i.opcode, i.operands, i.op_name, i.known_trip_count) == (
        "while",
        ("t",),
        "jit(f)/while",
        12,
    )
    assert i.called() == [("body", "b"), ("condition", "c")] and i.line_number == 7
    assert ht.parse_instruction(
        "%x = f32[2]{0} all-gather(f32[1]{0} %y), channel_id=4"
    ).operands == ("y",)
