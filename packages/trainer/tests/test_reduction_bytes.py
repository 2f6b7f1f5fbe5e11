"""reduction_bytes reads what a reduction reduces, not the buffer XLA:TPU moves it in
(docs/cost_model.md, "Which bytes are exact"): on a hand-written module, no compile."""

import hlo_tools
from trainer.step import reduction_bytes

# One device's 32-element shard gathered as an all-reduce of a dynamic-update-slice
# into zeros (XLA:TPU's small all-gather), one f32[4,64] gradient all-reduced in the
# slice, then sent across slices padded to f32[4,128] tiles by ZeroCrop.
HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[32], p1: f32[4,64]) -> (f32[256], f32[4,64]) {
  %p0 = f32[32] parameter(0)
  %p1 = f32[4,64] parameter(1)
  %zero = f32[] constant(0)
  %zeros = f32[256] broadcast(%zero), dimensions={}
  %i = s32[] constant(0)
  %dus = f32[256] dynamic-update-slice(%zeros, %p0, %i)
  %gathered = f32[256] all-reduce(%dus), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %grad = f32[4,64] all-reduce(%p1), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %crop = f32[4,128] custom-call(%grad), custom_call_target="ZeroCrop"
  %flat = f32[512] bitcast(%crop)
  %token = token[] after-all()
  %send = (f32[512], u32[], token[]) send(%flat, %token), channel_id=2, MEGASCALE
  %done = token[] send-done(%send), channel_id=2, is_host_transfer=true
  ROOT %t = (f32[256], f32[4,64]) tuple(%gathered, %grad)
}
""".replace(
    "MEGASCALE",
    'is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}',
)


def test_gathers_in_disguise_and_tile_padding_are_not_gradient_bytes():
    module = hlo_tools.parse(HLO)
    gathered, grad, send = hlo_tools.collectives(module)
    assert reduction_bytes.is_gather(module, gathered)
    assert not reduction_bytes.is_gather(module, grad)
    # The records themselves: 1,024 B gathered, 2,048 B sent (half of it padding).
    assert (gathered.bytes, send.bytes, send.cross_slice) == (1024, 2048, True)
    # Counted: the gradient only, at its own size in the slice and across slices.
    assert reduction_bytes.counted(module, {"data": 8}, ["data"]) == ({"data": 0}, {"data": 1024})
    assert reduction_bytes.counted_cross_slice(module) == (0, 1024)
