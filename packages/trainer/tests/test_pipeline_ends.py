"""Pipeline stages run the embedding, dense layers, head, loss and MTP one pipeline
microbatch at a time (model/pipeline_ends.py): the compiled step's logits are one
microbatch's, never the step's. (Same numbers as data=8: test_pipeline.py.)"""

import re

import numpy as np

from trainer.config import make_config

# test_pipeline.py's MODEL over stage=2 x data=4 (its first same-number layout: one
# compile shared with it when both run): 1 dense + 4 MoE layers, one MTP depth,
# 4 pipeline microbatches.
KEYS = {
    "base_num_decoder_layers": "5",
    "mtp_num_layers": "1",
    "gradient_accumulation_steps": "4",
    "ici_pipeline_parallelism": "2",
    "ici_data_parallelism": "4",
}
# conftest's runner: 32 sequences a step whatever the layout, so 8 per data shard,
# 2 per pipeline microbatch.
STEP_ROWS, MICROBATCHES, DATA = 32, 4, 4


def test_logits_exist_for_one_microbatch_at_a_time(runner):
    _, text = runner(1, **KEYS)
    config = make_config({"model_name": "tagtrain-tiny", **KEYS})
    vocab, seq = config.vocab_size, config.max_target_length
    rows = STEP_ROWS // DATA  # one device's rows of the step
    micro = rows // MICROBATCHES
    # Every f32 array of the per-device program with a last dim of the vocab: its
    # other dims.
    shapes = {
        tuple(int(d) for d in dims.split(","))
        for dims in re.findall(rf"f32\[([0-9,]+),{vocab}\]", text)
    }
    # The head's logits of one microbatch are there...
    assert (micro, seq) in shapes, shapes
    # ...and no vocab-wide array holds as many tokens as the device's share of the
    # step (before, the head ran on the whole batch: (8, 32, 256) and (256, 256)).
    tokens = {int(np.prod(s)) for s in shapes}
    assert max(tokens) < rows * seq, shapes
