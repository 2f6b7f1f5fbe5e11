"""SFT training (use_sft, issue 45): from hf_model_path=fixtures/hf/v3_chat on
examples/chat/train.jsonl, the step's loss is the mean over the counted (assistant)
tokens of the whole step, both microbatches together, the loss falls, and evaluation
masks the same way. One configuration, its train and eval steps compiled once."""

from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import model as model_lib
from trainer.config import make_config
from trainer.run import run as run_lib

CHAT = Path(__file__).parent / "fixtures" / "hf" / "v3_chat"
EXAMPLES = Path(__file__).parents[3] / "examples" / "chat"
MICROBATCHES = 2


def _config(**overrides):
    return make_config(
        {
            "hf_model_path": str(CHAT),
            "dataset_type": "hf",
            "use_sft": "true",
            "hf_train_files": str(EXAMPLES / "train.jsonl"),
            "hf_eval_files": str(EXAMPLES / "held_out.jsonl"),
            "eval_interval": "8",
            "dtype": "float32",
            "max_target_length": "64",
            "per_device_batch_size": "1",  # 8 rows per microbatch on 8 devices, 16 per step
            "gradient_accumulation_steps": str(MICROBATCHES),
            "steps": "8",
            "learning_rate": "0.01",
            **overrides,
        }
    )


def _host(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


class FirstBatchThinned:
    """The run's source, with the first step's even rows (microbatch 0's: accum's
    microbatch i holds rows i, i + 2, ...) counting only from position 32 on, so the
    two microbatches count different numbers of tokens (the examples' rows all count
    the same)."""

    def __init__(self, source):
        self.source, self.global_batch = source, source.global_batch

    def rows(self, step, start, stop):
        rows = self.source.rows(step, start, stop)
        if step == 0:
            rows["weights"] = rows["weights"].copy()
            for row in range(start, stop):
                if row % MICROBATCHES == 0:
                    rows["weights"][row - start, :32] = 0.0
        return rows

    def describe(self):
        return self.source.describe()


@pytest.fixture(scope="module")
def trained():
    """The state before the first step, the first step's batch, and an 8-step run."""
    run = run_lib.setup(_config())
    run.source = FirstBatchThinned(run.source)
    run_lib.compile_step(run)
    start = _host({"params": run.state["params"], "router": run.state["router"]})
    batch = run.source.rows(0, 0, run.batch_size)
    history = run_lib.train(run)
    return dict(run=run, start=start, batch=batch, history=history)


def _token_losses(params, router, batch):
    """-log p(target) per token, from a plain single-device forward, in float64."""
    single = run_lib.setup(_config(eval_interval="-1"), jax.devices()[:1])
    place = lambda tree, like: jax.tree.map(  # noqa: E731
        lambda x, y: jax.device_put(x, y.sharding), tree, like
    )
    forward = jax.jit(lambda p, r, b: model_lib.apply(single.model, p, r, *b)[0])
    with jax.set_mesh(single.ctx.mesh):
        logits = forward(
            place(params, single.state["params"]),
            place(router, single.state["router"]),
            (batch["inputs"], batch["positions"], batch["segments"]),
        )
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    return -np.take_along_axis(np.asarray(logp), batch["targets"][..., None], -1)[..., 0]


def test_the_loss_is_the_mean_over_the_steps_counted_tokens(trained):
    batch, start = trained["batch"], trained["start"]
    weights = batch["weights"].astype(np.float64)
    assert 0 < weights.sum() < (batch["segments"] > 0).sum()  # prompts are not counted
    nll = _token_losses(start["params"], start["router"], batch)
    expected = (nll * weights).sum() / weights.sum()
    first = trained["history"][0]
    np.testing.assert_allclose(first["loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(first["ce_loss"], expected, rtol=1e-5)
    assert first["tokens"] == weights.sum()
    # Not the mean of the microbatches' means: they count different numbers of tokens.
    counts = [weights[i::MICROBATCHES].sum() for i in range(MICROBATCHES)]
    assert counts[0] != counts[1]
    means = [(nll * weights)[i::MICROBATCHES].sum() / counts[i] for i in range(MICROBATCHES)]
    assert abs(np.mean(means) - expected) > 1e-3 * expected


def test_fine_tuning_lowers_the_loss_and_evaluation_masks_the_same_way(trained):
    losses = [m["loss"] for m in trained["history"]]
    assert np.isfinite(losses).all() and np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2])
    run = trained["run"]
    (step, result), = run.evals  # fmt: skip
    assert step == 8
    # Only the held-out replies count: the eval set's counted targets, once each.
    assert result["eval_tokens"] == run.evaluator.eval_set.source.text.packed.counted_targets()
    assert result["eval_tokens"] < int(run.evaluator.eval_set.source.text.packed.piece_len.sum())
    assert np.isfinite(result["eval_loss"])


def test_startup_and_step_lines_say_what_the_loss_averages(trained):
    run = trained["run"]
    lines = run_lib.data_lines(run)
    assert lines[0].startswith("data: sft, 1 files, 48 conversations, tokenizer.json")
    assert lines[1].startswith("loss: mean over the step's counted tokens (assistant tokens")
    assert "not a mean of microbatch means" in lines[1]
    first = trained["history"][0]
    assert run_lib.step_line(1, first, counted=True).endswith(f"counted {first['tokens']:,.0f}")
