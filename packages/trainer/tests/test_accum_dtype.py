"""accum_dtype=bfloat16: the microbatch loop carries a bf16 accumulator, and the losses
stay within bf16 rounding of float32 accumulation."""

import numpy as np

import hlo_tools as ht
from hlo_tools.shapes import leaf_arrays

GA = 4
# test_train.py's explicit GA=4 case (f32 compute and weights: every bf16 array in
# the compiled step is the accumulator's), so the f32 run is shared with it.
CASE = dict(shard_mode="explicit", gradient_accumulation_steps=str(GA))


def _carried(text: str) -> dict[str, int]:
    """Elements per dtype in the carry of the step's microbatch loop (trip count GA)."""
    module = ht.parse(text)
    loops = [
        i
        for i in module.entry.instructions
        if i.opcode == "while" and ht.call_graph(module).loop(module.entry, i).trip_count == GA
    ]
    assert len(loops) == 1, [i.name for i in loops]
    out: dict[str, int] = {}
    for a in leaf_arrays(loops[0].type):
        out[a.dtype] = out.get(a.dtype, 0) + a.elements
    return out


def test_bf16_accumulator_is_carried_in_bf16_and_tracks_f32(runner):
    f32_history, f32_text = runner(6, **CASE)
    bf16_history, bf16_text = runner(6, **CASE, accum_dtype="bfloat16")
    f32, bf16 = _carried(f32_text), _carried(bf16_text)
    assert "bf16" not in f32
    # The accumulator moved from f32 to bf16, whole: half its bytes.
    assert bf16.get("bf16", 0) > 0
    assert f32["f32"] - bf16["f32"] == bf16["bf16"]
    losses = [m["loss"] for m in bf16_history]
    np.testing.assert_allclose(losses, [m["loss"] for m in f32_history], rtol=1e-2)
