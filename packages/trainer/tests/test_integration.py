"""Real accelerators (TPU or GPU, >= 4 devices): one reduction per step, and what it is worth.

Run with `uv run nox -s tpu_integration` (GPUs: `uv run pytest -m integration`).
Elsewhere every test skips, saying why. Step-time and HBM assertions live only here.
"""

from __future__ import annotations

import gc
import statistics

import jax
import pytest

import hlo_tools
from trainer.config import make_config
from trainer.run import run as run_lib

pytestmark = pytest.mark.integration

GIB = 1024**3
MIN_DEVICES = 4
MIN_DEVICE_GIB = 24  # the 0.76B-parameter scale test's per-device budget


@pytest.fixture(scope="module")
def accelerators():
    found = [d for d in jax.devices() if d.platform != "cpu"]
    if len(found) < MIN_DEVICES:
        platforms = sorted({d.platform for d in jax.devices()})
        pytest.skip(
            f"needs >= {MIN_DEVICES} accelerator devices; this host has {len(found)} ({platforms})"
        )
    return found


def test_tiny_model_trains_and_reduces_once_per_step(accelerators):
    config = make_config(
        {"steps": "6", "per_device_batch_size": "1", "gradient_accumulation_steps": "4"}
    )
    run = run_lib.setup(config, accelerators)
    compiled = run_lib.compile_step(run)
    hlo_tools.assert_reduced_once_per_step(compiled.as_text())
    losses = [m["loss"] for m in run_lib.train(run)]
    assert losses[-1] < losses[0], losses


# The seed's scale test, generalized to any accelerator platform: deepseek3-small
# (24 layers, 16 experts, 0.76B parameters), data parallel over every device with
# ZeRO-1, GA=4, two 1024-token sequences per device per microbatch, bf16.
SCALE = {
    "model_name": "deepseek3-small",
    "ici_data_parallelism": "-1",
    "shard_optimizer_over_data": "true",
    "gradient_accumulation_steps": "4",
    "per_device_batch_size": "2",
    "dtype": "bfloat16",
    "enable_tensorboard": "false",
}
WARMUP_STEPS, MEASURED_STEPS = 4, 8
MIN_SPEEDUP = 1.05
MAX_MEMORY_RATIO = 1.02
MIN_PEAK_BYTES = 4 * GIB  # so the configuration cannot silently shrink below meaning


def _memory_stats(device) -> dict | None:
    """`device.memory_stats()`, or None where the platform does not report it."""
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    return stats or None


def _peak_bytes(devices) -> int:
    """Highest `peak_bytes_in_use` over the devices: a high-water mark that never resets."""
    return max(_memory_stats(d).get("peak_bytes_in_use", 0) for d in devices)


@pytest.fixture(scope="module")
def big_accelerators(accelerators):
    stats = [_memory_stats(d) for d in accelerators]
    if any(s is None or "bytes_limit" not in s or "peak_bytes_in_use" not in s for s in stats):
        pytest.skip(
            f"{accelerators[0].platform} devices do not report bytes_limit and "
            "peak_bytes_in_use in memory_stats(); the scale test needs both"
        )
    smallest = min(s["bytes_limit"] for s in stats) / GIB
    if smallest < MIN_DEVICE_GIB:
        pytest.skip(f"needs >= {MIN_DEVICE_GIB} GiB per device; the smallest has {smallest:.1f}")
    return accelerators


def _train_and_time(defer: bool, devices) -> tuple[float, str, list[float], int]:
    """(median step seconds after warm-up, compiled HLO text, losses, router-count
    elements) for one variant.

    Everything the run allocated is released before returning, so the second
    variant's peak is its own plus nothing left over from the first."""
    config = make_config(
        {
            **SCALE,
            "steps": str(WARMUP_STEPS + MEASURED_STEPS),
            "gradient_reduction_policy": "deferred" if defer else "per_microbatch",
        }
    )
    run = run_lib.setup(config, devices)
    text = run_lib.compile_step(run).as_text()
    history = run_lib.train(run)
    seconds = statistics.median(m["step_time_s"] for m in history[WARMUP_STEPS:])
    losses = [m["loss"] for m in history]
    counts = config.num_moe_layers * config.num_experts
    del run, history
    gc.collect()
    return seconds, text, losses, counts


def test_deferred_reduction_is_faster_at_scale_and_costs_no_memory(big_accelerators):
    # Untagged (per-microbatch reduction) first, on purpose: peak_bytes_in_use is
    # a high-water mark the allocator never resets, so the second reading is
    # max(both) and "tagged peak <= 1.02 x untagged peak" cannot hide a regression.
    untagged_s, untagged_text, untagged_losses, counts = _train_and_time(False, big_accelerators)
    untagged_peak = _peak_bytes(big_accelerators)
    tagged_s, tagged_text, tagged_losses, _ = _train_and_time(True, big_accelerators)
    tagged_peak = _peak_bytes(big_accelerators)
    speedup = untagged_s / tagged_s
    ratio = tagged_peak / untagged_peak
    print(
        f"\nuntagged: {untagged_s:.4f} s/step, peak {untagged_peak / GIB:.4f} GiB"
        f"\ntagged:   {tagged_s:.4f} s/step, peak {tagged_peak / GIB:.4f} GiB"
        f"\nspeedup {speedup:.3f}x, peak ratio {ratio:.5f} "
        f"({len(big_accelerators)} x {big_accelerators[0].device_kind})"
    )
    # The live compile: every gradient reduced once per step when tagged (the
    # router's s32 token counts, per MoE layer and expert, stay per microbatch),
    # and the untagged baseline really reduces inside the loop.
    assert counts < make_config(SCALE).base_emb_dim
    hlo_tools.assert_reduced_once_per_step(tagged_text, max_in_loop_elements=counts)
    assert hlo_tools.in_loop_reductions(untagged_text, max_in_loop_elements=counts)
    assert untagged_peak > MIN_PEAK_BYTES, f"peak {untagged_peak / GIB:.2f} GiB: config shrank"
    assert ratio < MAX_MEMORY_RATIO, f"tagging raised peak memory {ratio:.4f}x"
    assert speedup > MIN_SPEEDUP, f"deferred reduction only {speedup:.3f}x faster"
    assert tagged_losses[-1] < tagged_losses[0] and untagged_losses[-1] < untagged_losses[0]
