"""The floor (a hand-written shard_map data-parallel step) and our explicit path beside it."""

import jax
import numpy as np
import pytest

import hlo_tools
from trainer.config import make_config
from trainer.run import floor
from trainer.run import run as run_lib
from trainer.sharding import ShardCtx

# data=8, GA=4, f32 so the two steps can be compared tightly.
VALUES = {
    "model_name": "tagtrain-tiny",
    "dtype": "float32",
    "per_device_batch_size": "1",
    "gradient_accumulation_steps": "4",
    "steps": "2",
    "enable_tensorboard": "false",
}


def _train(setup) -> tuple[list[dict], object]:
    run = setup(make_config(VALUES), jax.devices())
    run_lib.compile_step(run)
    return run_lib.train(run), run.compiled


@pytest.fixture(scope="module")
def both():
    return {"floor": _train(floor.setup_floor), "explicit": _train(run_lib.setup)}


def test_floor_step_matches_the_explicit_step(both):
    floor_history, _ = both["floor"]
    explicit_history, _ = both["explicit"]
    for got, want in zip(floor_history, explicit_history, strict=True):
        for key in ("loss", "grad_norm", "balance_loss"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
        np.testing.assert_array_equal(got["tokens_per_expert"], want["tokens_per_expert"])
    assert explicit_history[1]["loss"] < explicit_history[0]["loss"]


@pytest.mark.parametrize("name", ["floor", "explicit"])
def test_no_collective_of_any_size_inside_the_loop(both, name):
    """Gradients, loss sums, token counts, balance losses: all reduced after the loop."""
    text = both[name][1].as_text()
    # A threshold of 0 elements: even a scalar all-reduce in the loop fails.
    outside = hlo_tools.assert_reduced_once_per_step(text, max_in_loop_elements=0)
    assert sum(c.elements for c in outside) > 200_000  # the gradients (0.217M params)
    assert hlo_tools.traffic(hlo_tools.parse(text))["in_loop"] == {}


def test_explicit_step_needs_no_more_memory_than_the_floor(both):
    """No stacked copy of the MoE weights saved for the backward pass (see moe_kernels)."""
    floor_memory = both["floor"][1].memory_analysis()
    explicit_memory = both["explicit"][1].memory_analysis()
    assert explicit_memory.temp_size_in_bytes <= 1.01 * floor_memory.temp_size_in_bytes


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"ici_data_parallelism": "4", "ici_fsdp_parallelism": "2"}, "ici_fsdp_parallelism=2"),
        ({"shard_optimizer_over_data": "true"}, "shard_optimizer_over_data"),
        ({"mtp_num_layers": "1"}, "mtp_num_layers=0"),
    ],
)
def test_floor_refuses_layouts_beyond_data_parallelism(overrides, named):
    config = make_config({**VALUES, **overrides})
    with pytest.raises(ValueError, match=named):
        floor.setup_floor(config, jax.devices())


def test_shard_ctx_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'manual-ish'"):
        ShardCtx(mesh=None, rules=(), mode="manual-ish")
