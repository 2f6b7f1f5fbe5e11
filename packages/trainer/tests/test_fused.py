"""gradient_accumulation_schedule fused, overlapped and overlapped_ring on the trainer's
layouts: the plain path's numbers, its gradient bytes, nothing reduced in the microbatch loop."""

import numpy as np
import pytest

import hlo_tools as ht
from trainer.config import make_config, mesh_shape
from trainer_tests_layouts import EIGHT_DEVICE_LAYOUTS

GA = {"gradient_accumulation_steps": "4"}
# Three scanned (MoE) layers: the overlapped reduction is pipelined by one layer
# (the scan reduces layers 2..1, layer 0 after it), and tagtrain-tiny's two would
# leave a one-iteration scan, which XLA inlines.
LAYERS = {"base_num_decoder_layers": "4"}
FLOATS = ("f32", "bf16")
# Every layout in the slow tier (two compiles of the tiny model each, ~45 s of the cpu
# tier's 15 minutes): `uv run nox -s slow`. The cpu tier checks the fused and
# overlapped schedules' numbers and reductions in accum's test_fused.py, and the
# trainer's fused schedule in test_hierarchical.py.
slow = pytest.mark.slow
PLAIN = {"gradient_accumulation_schedule": "plain"}
# overlapped_ring: ZeRO-1's per-layer reduce-scatters as rings of permutes (the
# accum tests check the ring's numbers and permutes in the cpu tier).
CASES = [
    pytest.param("data+zero1", "overlapped", marks=slow),
    pytest.param("data+zero1", "overlapped_ring", marks=slow),
    pytest.param("data", "overlapped", marks=slow),
    pytest.param("data", "fused", marks=slow),
    pytest.param("data+fsdp", "overlapped", marks=slow),
    pytest.param("data+expert", "overlapped", marks=slow),
]


def _reduction_bytes(text: str) -> float:
    """Gradient-reduction bytes per step on the wire (hlo_tools.wire_bytes: the same
    for a gradient reduced by all-reduce, reduce-scatter or a ring of permutes):
    floating arrays (not scalars: XLA may fold a loss sum into a gradient reduction
    on one path only), trip-count weighted. A per-layer reduce-scatter can leave
    few elements per device: no size cutoff."""
    total = 0.0
    for c in ht.collectives(ht.parse(text)):
        if not ((c.kind in ht.REDUCTION_KINDS and c.cross_replica) or ht.is_ring_reduction(c)):
            continue
        counted = sum(a.bytes for a in c.arrays if a.elements > 1 and a.dtype in FLOATS)
        total += c.multiplier * counted * ht.wire_bytes(c) / c.bytes
    return total


@pytest.mark.parametrize(("layout", "schedule"), CASES)
def test_same_numbers_and_bytes_as_deferred(runner, grads_runner, grads_match, layout, schedule):
    base = {**EIGHT_DEVICE_LAYOUTS[layout], **GA, **LAYERS}
    # The reference: the unfused path (per-microbatch gradients added after the
    # backward pass); fused accumulation is the default.
    want_history, want_text = runner(1, **base, **PLAIN)
    keys = {"gradient_accumulation_schedule": schedule}
    got_history, got_text = runner(1, **base, **keys)
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(got_history[0][name], want_history[0][name], rtol=1e-5)
    want, got = grads_runner(1, **base, **PLAIN), grads_runner(1, **base, **keys)
    grads_match(got, want, rtol=1e-5)
    # Each gradient reduced once per step: no in-loop reduction over the data
    # axis (FSDP's per-use reduce-scatters over its own axis are allowed, as on
    # the deferred path), and the same bytes per step in all.
    module = ht.parse(got_text)
    sizes = mesh_shape(make_config({"model_name": "tagtrain-tiny", **base}), 8)
    judged = ht.verdict(module, mesh_shape=sizes, over=("data",))
    assert judged["status"] == "OK", judged["message"]
    assert _reduction_bytes(got_text) == pytest.approx(_reduction_bytes(want_text), rel=1e-9)
    if schedule == "overlapped_ring":
        # ZeRO-1's scanned layers: rings of permutes, no reduce-scatter left in the scan.
        in_scan = ht.overlapped_reductions(module)
        assert any(ht.is_ring_reduction(c) for c in in_scan)
        assert not [c for c in in_scan if c.kind == "reduce-scatter"]
    elif schedule == "overlapped":
        # The scanned layers' share runs layer by layer in the last backward.
        assert ht.overlapped_reductions(module)
    else:
        assert not ht.overlapped_reductions(module)
