"""Source lines from an instruction's metadata: StackFrames tables and source_file."""

from hlo_tools import parse_instruction
from hlo_tools.frames import Frame, StackFrames

# The tables as XLA prints them: a StackFrames row names its parent's id plus one
# (so a root names itself); read against a compile whose whole chain was known.
TABLES = """HloModule m

FileNames
1 "/home/me/train.py"
2 "/home/me/model.py"

FunctionNames
1 "<module>"
2 "loss_fn"

FileLocations
1 {file_name_id=1 function_name_id=1 line=17 end_line=17 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=9 end_line=9 column=4 end_column=4}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
"""


def _instr(metadata: str):
    return parse_instruction(f"%a = f32[4]{{0}} add(%x, %y), metadata={{{metadata}}}")


def test_stack_frame_id_resolves_to_the_chain_innermost_first():
    frames = StackFrames(TABLES).of(_instr('op_name="jit(f)/add" stack_frame_id=2'))
    assert frames == [
        Frame("/home/me/model.py", 9, "loss_fn"),
        Frame("/home/me/train.py", 17, "<module>"),
    ]
    assert str(frames[0]) == "/home/me/model.py:9 (loss_fn)"


def test_source_file_metadata_without_tables():
    frames = StackFrames("").of(_instr('op_name="x" source_file="/a/b.py" source_line=12'))
    assert frames == [Frame("/a/b.py", 12)]


def test_no_metadata_no_frames():
    assert StackFrames(TABLES).of(_instr('op_name="x"')) == []
    assert StackFrames(TABLES).stack(99) == []
