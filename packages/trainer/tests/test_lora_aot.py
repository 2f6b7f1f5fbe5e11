"""LoRA compiled for a TPU topology on this host (aot tier): tagtrain-test with adapters
on every target group, ZeRO-1, GA=4 on v5e-8. `uv run --extra tpu pytest -m aot`."""

import jax
import pytest

import hlo_tools
from trainer.config import make_config
from trainer.run import aot

pytestmark = pytest.mark.aot
pytest.importorskip("libtpu", reason="needs the tpu extra (libtpu): uv run --extra tpu")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    config = make_config(
        {
            "base_output_directory": str(tmp_path_factory.mktemp("aot")),
            "model_name": "tagtrain-test",
            "compile_topology": "v5e-8",
            "gradient_accumulation_steps": "4",
            "per_device_batch_size": "1",
            "shard_optimizer_over_data": "true",
            "gradient_reduction_policy": "deferred",
            "lora_rank": "8",
            "lora_targets": "attention,mlp,experts,shared_experts",
        }
    )
    return aot.compile_for_topology(config)


def test_v5e8_lora_reduces_the_adapters_once_after_the_loop(compiled):
    text = compiled.compiled.as_text()
    # Nothing reduced inside the microbatch loop, not even a scalar.
    outside = hlo_tools.assert_reduced_once_per_step(text, max_in_loop_elements=0)
    assert hlo_tools.traffic(hlo_tools.parse(text))["in_loop"] == {}
    state = compiled.run.state
    adapters = sum(x.size for x in jax.tree.leaves(state["params"]))
    base = sum(x.size for x in jax.tree.leaves(state["frozen"]))
    # Every adapter gradient element is reduced (a reduce-scatter onto the ZeRO-1
    # shards counts its whole group), and nothing the size of a base gradient.
    reduced = sum(
        a.elements * (c.group_size if c.kind == "reduce-scatter" else 1)
        for c in outside
        for a in c.arrays
        if a.dims and a.dtype == "f32"
    )
    assert adapters <= reduced < adapters + base // 10, (reduced, adapters, base)
