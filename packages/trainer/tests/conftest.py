"""Trainer test fixtures: run the tiny model for a few steps, compiled once per configuration."""

from __future__ import annotations

import functools
import importlib.util
import struct
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer.config import make_config
from trainer.run import run as run_lib


def _load(name: str):
    """A sibling module of test data, registered as `trainer_tests_<name>` (tests run
    with --import-mode=importlib, so they import it by that name)."""
    spec = importlib.util.spec_from_file_location(
        f"trainer_tests_{name}", Path(__file__).parent / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


EIGHT_DEVICE_LAYOUTS = _load("layouts").EIGHT_DEVICE_LAYOUTS

# f32 compute so sharded and single-device runs can be compared at rtol 1e-4.
# STEP_ROWS_PER_DEVICE: sequences per device per optimizer step; `_run` turns it into
# per_device_batch_size (MaxText's meaning: per microbatch), so every run compared
# here trains on the same 32 sequences per step whatever its GA or device count.
BASE = {"model_name": "tagtrain-tiny", "dtype": "float32"}
STEP_ROWS_PER_DEVICE = 4


# Gradient leaves spot-checked across shardings (paths into the params dict).
SPOT_LEAVES = (
    ("embedding_VxD",),
    ("logits_DxV",),
    ("dense_layers", "attn", "wq_a_DxQ"),
    ("moe_layers", "attn", "wkv_b_CxHxNV"),
    ("moe_layers", "ffn", "wi_0"),
    ("moe_layers", "ffn", "gate"),
    # Multi-token prediction's own parameters (runs with mtp_num_layers > 0 only).
    ("mtp", "eh_proj_2xDxD"),
    ("mtp", "block", "attn", "wq_a_DxQ"),
)


def _adam_mu(opt_state):
    """Adam's first moment: after one step it is (1 - b1) x the clipped gradient."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")):
        if hasattr(node, "mu"):
            return node.mu
    raise AssertionError("no Adam state in the optimizer state")


@functools.cache
def _run(steps: int, devices: int, overrides: tuple) -> tuple[list[dict], str, dict]:
    values = {**BASE, **dict(overrides), "steps": str(steps)}
    ga = int(values.get("gradient_accumulation_steps", "1"))
    # Same global batch on fewer devices and at any GA.
    values["per_device_batch_size"] = str(STEP_ROWS_PER_DEVICE * 8 / devices / ga)
    run = run_lib.setup(make_config(values), jax.devices()[:devices])
    run_lib.compile_step(run)
    history = run_lib.train(run)
    mu = _adam_mu(run.state["opt_state"])
    spots = {}
    for path in SPOT_LEAVES:
        node = mu
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:  # leaves of an option the run has off are absent
            spots["/".join(path)] = np.asarray(node)
    return history, run.compiled.as_text(), spots


def run_steps(steps: int, devices: int = 8, **overrides: str) -> tuple[list[dict], str]:
    """(per-step metrics, compiled HLO text) for BASE + overrides on `devices` devices."""
    history, text, _ = _run(steps, devices, tuple(sorted(overrides.items())))
    return history, text


def spot_grads(steps: int, devices: int = 8, **overrides: str) -> dict:
    """Adam's first moment of SPOT_LEAVES after `steps` steps (the gradient after one)."""
    return _run(steps, devices, tuple(sorted(overrides.items())))[2]


def assert_grads_match(got: dict, want: dict, rtol: float) -> None:
    """Every spot leaf of `want` equals `got`'s within rtol, with an atol of rtol / 10
    of the leaf's largest magnitude (entries near zero carry only rounding)."""
    for leaf, value in want.items():
        scale = float(np.abs(value).max())
        np.testing.assert_allclose(
            got[leaf], value, rtol=rtol, atol=rtol / 10 * scale, err_msg=leaf
        )


@pytest.fixture(scope="session")
def grads_match():
    """`assert_grads_match`, for the modules that compare spot gradients."""
    return assert_grads_match


@pytest.fixture(scope="session")
def grads_runner():
    """`spot_grads`, sharing `runner`'s compiled runs."""
    return spot_grads


@pytest.fixture(scope="session")
def runner():
    """`run_steps`, shared by every trainer test module (its cache spans the session)."""
    return run_steps


# Issue 7's matrix (8 devices): the named layouts minus the two plain data ones,
# which test_train.py covers.
LAYOUTS = {k: v for k, v in EIGHT_DEVICE_LAYOUTS.items() if k not in ("data", "data+fsdp")}


# The matrix's layouts the cpu tier leaves to the slow tier, per mode (a test module
# names its mode in MATRIX_MODE), where the cpu tier checks the same sharding another
# way: explicit fsdp by test_train's data4xfsdp2 runs, fsdp+context by
# test_parallelism's context GA=4 test (the same layout and check), experts sharding
# the sequence by the auto run of that layout; auto mode keeps tensor, ZeRO-1 and
# both expert layouts, explicit mode checking the others. fsdp+tensor and
# fsdp+expert(fsdp) run in the cpu tier in explicit mode only (auto mode keeps the
# context-sharded experts): the cpu tier's 15 minutes on CI's two cores. data+zero1
# (8-way data, ZeRO-1) is test_train's explicit-data8-zero1-ga4 and auto-data8-zero1-ga1
# cases in the cpu tier (first step against one device; test_zero1_reduces_once_into_
# the_shards reads the explicit one's reductions), so the matrix runs it in the slow tier.
SLOW_LAYOUTS = {
    "explicit": ("fsdp", "fsdp+context", "fsdp+expert(context)", "data+zero1"),
    "auto": (
        "fsdp", "fsdp+context", "fsdp+tensor", "fsdp+tensor_transpose", "fsdp+expert(fsdp)",
        "data+expert", "data+zero1",
    ),
}  # fmt: skip


def pytest_generate_tests(metafunc):
    """Tests asking for `matrix_layout` run once per entry of LAYOUTS; those asking for
    `ga4_layout` once per entry of the module's DEFERRED_GA4 (checks sharing the
    matrix's GA=4 compile of that layout). Either is in the slow tier where the
    module's MATRIX_MODE's SLOW_LAYOUTS holds the layout."""
    slow = SLOW_LAYOUTS.get(getattr(metafunc.module, "MATRIX_MODE", None), ())
    for name, layouts in (
        ("matrix_layout", LAYOUTS),
        ("ga4_layout", getattr(metafunc.module, "DEFERRED_GA4", ())),
    ):
        if name in metafunc.fixturenames:
            metafunc.parametrize(
                name,
                [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in layouts],
            )


@pytest.fixture(scope="session")
def layouts():
    return LAYOUTS


@pytest.fixture(scope="session")
def check_layout(runner, grads_runner):
    """Assert one step of a layout in a mode matches a single-device run.

    Loss, grad norm and the spot-checked gradient leaves (Adam's first moment
    after one step), f32, rtol 1e-4. `extra` overrides (gradient_accumulation_steps)
    join the layout's; the run is `runner(1, **layout, shard_mode=mode, **extra)`, so
    a test asking for exactly that shares its compile.
    """
    ref_metrics = runner(1, devices=1)[0][0]
    ref_grads = grads_runner(1, devices=1)

    def check(name: str, mode: str, **extra: str) -> None:
        overrides = dict(LAYOUTS[name], shard_mode=mode, **extra)
        first = runner(1, **overrides)[0][0]
        np.testing.assert_allclose(first["loss"], ref_metrics["loss"], rtol=1e-4)
        np.testing.assert_allclose(first["grad_norm"], ref_metrics["grad_norm"], rtol=1e-4)
        assert_grads_match(grads_runner(1, **overrides), ref_grads, rtol=1e-4)

    return check


def _event_tags(path) -> dict[str, list[int]]:
    """Scalar tag -> steps, read straight from TFRecord-framed Event protos."""
    from tensorboardX.proto import event_pb2

    tags: dict[str, list[int]] = {}
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            tags.setdefault(value.tag, []).append(event.step)
    return tags


@pytest.fixture(scope="session")
def event_tags():
    """`event_tags(path)`: scalar tag -> steps of one TensorBoard event file."""
    return _event_tags
