"""Pipeline stages run the embedding, dense layers, head, loss and MTP one pipeline
microbatch at a time (model/pipeline_ends.py): the step's logits are one
microbatch's, never the step's. (Same numbers as data=8: test_pipeline.py.)

The cpu tier reads the per-device shapes off the traced step (5 s) rather than the
compiled one (the compile took 28 s of the tier): each end is one `jax.shard_map` over
every mesh axis, whose arrays are per device as traced (XLA's partitioner keeps a
manual region's shapes), and an array outside one is counted by its shard's shape.
The compiled step's shapes are checked in the slow tier, below.
"""

import re

import jax
import numpy as np
import pytest

from trainer.config import make_config
from trainer.run import run as run_lib

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
CONFIG = make_config({"model_name": "tagtrain-tiny", **KEYS})


def _assert_one_microbatch(shapes: set[tuple[int, ...]]) -> None:
    """`shapes`: the dims before the vocab of every per-device f32 array whose last
    dim is the vocab."""
    seq = CONFIG.max_target_length
    rows = STEP_ROWS // DATA  # one device's rows of the step
    micro = rows // MICROBATCHES
    # The head's logits of one microbatch are there...
    assert (micro, seq) in shapes, shapes
    # ...and no vocab-wide array holds as many tokens as the device's share of the
    # step (before, the head ran on the whole batch: (8, 32, 256) and (256, 256)).
    tokens = {int(np.prod(s)) for s in shapes}
    assert max(tokens) < rows * seq, shapes


def _traced_shapes(jaxpr, manual: bool = False) -> set[tuple[int, ...]]:
    """`_assert_one_microbatch`'s shapes among the values `jaxpr` and the jaxprs
    nested in it compute: inside a shard_map as traced, outside it a shard's."""
    shapes = set()
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            shape = getattr(aval, "shape", ())
            if shape and shape[-1] == CONFIG.vocab_size and aval.dtype == np.float32:
                if not manual:  # explicit mode: every aval has its NamedSharding
                    shape = aval.sharding.shard_shape(shape)
                shapes.add(tuple(shape[:-1]))
        inner_manual = manual or eqn.primitive.name == "shard_map"
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's open one
                if hasattr(sub, "eqns"):
                    shapes |= _traced_shapes(sub, inner_manual)
    return shapes


def test_logits_exist_for_one_microbatch_at_a_time():
    # conftest's runner's run (f32; per_device_batch_size per microbatch), traced.
    values = {**KEYS, "model_name": "tagtrain-tiny", "dtype": "float32", "steps": "1"}
    run = run_lib.setup(make_config({**values, "per_device_batch_size": "1"}))
    with jax.set_mesh(run.ctx.mesh):
        traced = run.step_fn.trace(run.state, run_lib.batch_for(run, 0))
    _assert_one_microbatch(_traced_shapes(traced.jaxpr.jaxpr))


@pytest.mark.slow  # the cpu tier checks the traced step's shapes, above
def test_the_compiled_step_holds_one_microbatch_s_logits(runner):
    _, text = runner(1, **KEYS)
    # Every f32 array of the per-device program with a last dim of the vocab: its
    # other dims.
    _assert_one_microbatch({
        tuple(int(d) for d in dims.split(","))
        for dims in re.findall(rf"f32\[([0-9,]+),{CONFIG.vocab_size}\]", text)
    })  # fmt: skip
