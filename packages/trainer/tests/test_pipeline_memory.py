"""The pipeline keeps no copy of its stage's weights per iteration (issue 57, item 5).

Under remat_policy=full a layer's residuals are its inputs. Each layer's weights
used to be picked from the stage's chunks outside the rematerialized layer, so the
picked copy was a residual that both loops stacked: the stage's whole weights once
per pipeline iteration (deepseek3-671b on v5p: about 3.3 GB a device an iteration,
208.81G of HLO temporaries; model/pipeline.py's `pick`). Here each extra microbatch
of 4 sequences cost exactly one more copy of the stage's weights (3.6 MB); now it
costs its own activations (about 25 KB). Compiled memory is an HLO fact: no device,
no timing.
"""

import jax
import pytest

from trainer.config import make_config
from trainer.run import run as run_lib

# 1 dense + 2 MoE layers: one MoE layer a stage, its weights (wide experts) far
# larger than one microbatch's activations, so a copy an iteration stands out.
KEYS = {
    "model_name": "tagtrain-tiny",
    "dtype": "float32",
    "steps": "1",
    "base_num_decoder_layers": "3",
    "base_moe_mlp_dim": "512",
    "remat_policy": "full",
    "ici_pipeline_parallelism": "2",
    "ici_data_parallelism": "4",
}
PER_MICROBATCH = "0.5"  # 4 sequences a microbatch: one per data shard


def _compiled(microbatches: int):
    """(temporary bytes, one device's bytes of its stage's MoE weights)."""
    config = make_config(
        {
            **KEYS,
            "gradient_accumulation_steps": str(microbatches),
            "per_device_batch_size": PER_MICROBATCH,
        }
    )
    run = run_lib.setup(config, jax.devices()[:8])
    temp = run_lib.compile_step(run).memory_analysis().temp_size_in_bytes
    stage = jax.tree.leaves(run.state["params"]["moe_layers"])
    return temp, sum(leaf.addressable_shards[0].data.nbytes for leaf in stage)


# Slow tier (two pipeline compiles, ~40 s of the cpu tier's 15 minutes); the cpu tier
# keeps test_pipeline.py's numbers and schedules.
@pytest.mark.slow
def test_an_extra_microbatch_costs_less_than_the_stage_weights():
    # 3 and 9 pipeline iterations (m + p - 1) of equal microbatches.
    (few, weights), (many, _) = _compiled(2), _compiled(8)
    per_microbatch = (many - few) / 6
    assert per_microbatch < weights, (few, many, weights)
