"""Real accelerators (TPU or GPU, >= 4 devices): the tiny model trains with one reduction per step.

Run with `uv run nox -s tpu_integration`. Elsewhere every test skips, saying why.
"""

import jax
import pytest

import hlo_tools
from trainer import run as run_lib
from trainer.config import make_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def accelerators():
    found = [d for d in jax.devices() if d.platform != "cpu"]
    if len(found) < 4:
        platforms = sorted({d.platform for d in jax.devices()})
        pytest.skip(f"needs >= 4 accelerator devices; this host has {len(found)} ({platforms})")
    return found


def test_tiny_model_trains_and_reduces_once_per_step(accelerators):
    config = make_config(
        {"steps": "6", "per_device_batch_size": "4", "gradient_accumulation_steps": "4"}
    )
    run = run_lib.setup(config, accelerators)
    compiled = run_lib.compile_step(run)
    hlo_tools.assert_reduced_once_per_step(compiled.as_text())
    losses = [m["loss"] for m in run_lib.train(run)]
    assert losses[-1] < losses[0], losses
