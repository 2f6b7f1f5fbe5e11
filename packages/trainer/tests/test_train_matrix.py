"""The full matrix of issue 6, slow tier: meshes x modes x GA, each against one device."""

import itertools

import numpy as np
import pytest

import hlo_tools

pytestmark = pytest.mark.slow

MESHES = {
    "data8": {},
    "data4xfsdp2": {"ici_data_parallelism": "4", "ici_fsdp_parallelism": "2"},
    "data8-zero1": {"shard_optimizer_over_data": "true"},
}
MATRIX = list(itertools.product(sorted(MESHES), ("explicit", "auto"), ("1", "4")))


@pytest.mark.parametrize("mesh,mode,ga", MATRIX, ids=["-".join(m) for m in MATRIX])
def test_matrix_first_step_and_placement(mesh, mode, ga, runner):
    reference, _ = runner(1, devices=1, gradient_accumulation_steps=ga)
    overrides = dict(MESHES[mesh], shard_mode=mode, gradient_accumulation_steps=ga)
    history, text = runner(1, **overrides)
    np.testing.assert_allclose(history[0]["loss"], reference[0]["loss"], rtol=1e-4)
    np.testing.assert_allclose(history[0]["grad_norm"], reference[0]["grad_norm"], rtol=1e-4)
    if mode == "explicit" and mesh != "data4xfsdp2":
        # 'data' is the only batch axis: no gradient all-reduce inside the entry loop.
        hlo_tools.assert_reduced_once_per_step(text)


@pytest.mark.parametrize(
    "option",
    ["scan_layers=false", "remat_policy=full", "remat_policy=selective", "sparse_matmul=false"],
)
def test_model_options_keep_the_numbers(option, runner):
    """Unrolled layers, full and selective remat and the dense MoE path compute the same
    step."""
    key, value = option.split("=")
    reference, _ = runner(1, gradient_accumulation_steps="4")
    history, _ = runner(1, gradient_accumulation_steps="4", **{key: value})
    np.testing.assert_allclose(history[0]["loss"], reference[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(history[0]["grad_norm"], reference[0]["grad_norm"], rtol=1e-4)


def test_bf16_weights_train(runner):
    history, _ = runner(3, weight_dtype="bfloat16")
    losses = [m["loss"] for m in history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
