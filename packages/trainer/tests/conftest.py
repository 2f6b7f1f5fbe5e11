"""Trainer test fixtures: run the tiny model for a few steps, compiled once per configuration."""

from __future__ import annotations

import functools

import jax
import pytest

from trainer import run as run_lib
from trainer.config import make_config

# f32 compute so sharded and single-device runs can be compared at rtol 1e-4.
BASE = {"model_name": "deepseek3-tiny", "dtype": "float32", "per_device_batch_size": "4"}


@functools.cache
def run_steps(steps: int, devices: int = 8, **overrides: str) -> tuple[list[dict], str]:
    """(per-step metrics, compiled HLO text) for BASE + overrides on `devices` devices."""
    values = {**BASE, **overrides, "steps": str(steps)}
    if devices != 8:
        # Same global batch on fewer devices.
        values["per_device_batch_size"] = str(float(values["per_device_batch_size"]) * 8 / devices)
    run = run_lib.setup(make_config(values), jax.devices()[:devices])
    run_lib.compile_step(run)
    history = run_lib.train(run)
    return history, run.compiled.as_text()


@pytest.fixture(scope="session")
def runner():
    """`run_steps`, shared by every trainer test module (its cache spans the session)."""
    return run_steps
