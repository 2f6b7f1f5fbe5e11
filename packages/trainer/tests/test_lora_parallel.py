"""LoRA under the other layouts (slow tier: one compile each): FSDP with expert
parallelism, MTP and a bf16 frozen base; ZeRO-1 with evaluation. In each, the
compiled GA=2 step reduces no gradient over 'data' inside the microbatch loop, what
it reduces is adapter-sized, and the base comes out of training bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import hlo_tools
from trainer.config import make_config
from trainer.run import run as run_lib

COMMON = {
    "lora_rank": "4",
    "lora_targets": "attention,mlp,experts,shared_experts",
    "gradient_accumulation_steps": "2",
    "gradient_reduction_policy": "deferred",
    "per_device_batch_size": "1",
    "steps": "2",
}
LAYOUTS = {
    "fsdp2-ep2-mtp-bf16": {
        "ici_fsdp_parallelism": "2",
        "ici_expert_parallelism": "2",
        "mtp_num_layers": "1",
        "weight_dtype": "bfloat16",
        "dtype": "bfloat16",
    },
    "zero1-eval": {
        "shard_optimizer_over_data": "true",
        "dtype": "float32",
        "eval_interval": "2",
        "eval_steps": "1",
    },
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trained(request):
    run = run_lib.setup(make_config({**COMMON, **LAYOUTS[request.param]}))
    base = jax.tree.map(lambda x: np.array(jax.device_get(x)), run.state["frozen"])
    run_lib.compile_step(run)
    startup = run_lib.startup_lines(run)
    history = run_lib.train(run)
    return request.param, run, base, startup, history


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_adapters_alone_are_reduced_once_per_step(trained):
    name, run, base, startup, history = trained
    head = next(line for line in startup if line.startswith("collectives per step"))
    assert "OK" in head, head
    module = hlo_tools.parse(run.compiled.as_text())
    adapters = _bytes(run.state["params"])
    outside = sum(c.bytes for c in hlo_tools.gradient_reductions_outside(module))
    inside = sum(
        (c.bytes_per_step or c.bytes)
        for c in hlo_tools.in_loop_reductions(module)
        if c.kind in hlo_tools.REDUCTION_KINDS
    )
    # A reduction of any base gradient would exceed these: the base is bigger than the
    # adapters; in the loop only FSDP's per-use reduce-scatters of the factors remain.
    assert 0 < outside <= adapters + 1024, (outside, adapters)
    assert inside <= 2 * adapters, (inside, adapters)
    assert _bytes(run.state["frozen"]) > 2 * adapters


@pytest.mark.slow
def test_base_is_untouched_and_training_moves(trained):
    name, run, base, _, history = trained
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, run.state["frozen"]), base)
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in history)
    frozen_dtypes = {str(x.dtype) for x in jax.tree.leaves(run.state["frozen"])}
    assert frozen_dtypes == ({"bfloat16"} if "bf16" in name else {"float32"})
    assert {str(x.dtype) for x in jax.tree.leaves(run.state["params"])} == {"float32"}
    if "eval" in name:
        assert [step for step, _ in run.evals] == [2]
        assert np.isfinite(run.evals[0][1]["eval_loss"])
