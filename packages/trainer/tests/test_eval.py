"""Held-out evaluation (issue 17): the eval loss against a plain single-device forward,
state untouched, training unchanged, resume during evaluation, records, bad keys.

One configuration, its train and eval steps compiled once for the module; every
other run here reuses those executables. The binary's eval line, records,
TensorBoard scalars and plot are checked on test_outputs.py's run.
"""

import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import model as model_lib
from trainer.config import ConfigError, make_config, mesh_shape
from trainer.data import eval_data, eval_schedule, synthetic_batch
from trainer.io import checkpoint_files, metrics, plots
from trainer.run import evaluate
from trainer.run import run as run_lib

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
WORDS = [
    "the",
    "river",
    "ran",
    "past",
    "the",
    "mill",
    "and",
    "the",
    "miller",
    "counted",
    "sacks",
    "of",
    "grain",
    "while",
    "the",
    "children",
    "watched",
    "boats",
    "drift",
    "down",
    "toward",
    "the",
    "town",
    "where",
    "bells",
    "rang",
    "at",
    "noon",
]


class Killed(Exception):
    """Stands in for the process dying in the middle of an evaluation."""


def _text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, words)) + ".\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Training and held-out text, composed here: ~6 KB to train on, ~1.2 KB to evaluate."""
    root = tmp_path_factory.mktemp("eval_corpus")
    (root / "train").mkdir()
    for i in range(3):
        (root / "train" / f"part{i}.txt").write_text(_text(i, 400))
    (root / "eval.txt").write_text(_text(99, 220))
    return root


def _config(corpus, out=None, **overrides):
    values = {
        "model_name": "tagtrain-tiny",
        "dtype": "float32",
        "vocab_size": "512",
        "per_device_batch_size": "1",
        "steps": "4",
        "dataset_type": "text",
        "dataset_path": str(corpus / "train"),
        "eval_dataset_path": str(corpus / "eval.txt"),
        "eval_interval": "2",
        # 2 per device: 16 sequences per eval batch, twice the training microbatch.
        "eval_per_device_batch_size": "2",
        "checkpoint_period": "2",
        **overrides,
    }
    if out is not None:
        values["base_output_directory"] = str(out)
    return make_config(values)


def _snapshot(state):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), state)


@pytest.fixture(scope="module")
def evaluated(corpus, tmp_path_factory):
    """A 4-step run evaluating after steps 2 and 4, and the same run without evaluation."""
    run = run_lib.setup(_config(corpus))
    run_lib.compile_step(run)
    history = run_lib.train(run)
    plain = run_lib.setup(_config(corpus, eval_interval="-1"))
    plain.compiled = run.compiled  # the same executable: evaluation must not change it
    return dict(run=run, history=history, plain=run_lib.train(plain))


def test_eval_set_is_the_whole_held_out_file_once(evaluated):
    run = evaluated["run"]
    eval_set = run.evaluator.eval_set
    rows = len(eval_set.source.text.packed)
    assert eval_set.batch_size == 16 and eval_set.steps == -(-rows // 16) >= 2
    # Every real target counted once; the padded tail of the last batch counts nothing.
    real = int(eval_set.source.text.packed.piece_len.sum())
    assert [step for step, _ in run.evals] == [2, 4]
    assert all(result["eval_tokens"] == real for _, result in run.evals)


def test_eval_loss_is_the_mean_next_token_loss_of_a_single_device_forward(evaluated, corpus):
    run = evaluated["run"]
    single = run_lib.setup(_config(corpus, eval_interval="-1"), jax.devices()[:1])
    state = _snapshot(run.state)
    place = lambda tree, like: jax.tree.map(  # noqa: E731
        lambda x, y: jax.device_put(x, y.sharding), tree, like
    )
    params = place(state["params"], single.state["params"])
    router = place(state["router"], single.state["router"])
    forward = jax.jit(lambda p, r, b: model_lib.apply(single.model, p, r, *b)[0])
    eval_set = run.evaluator.eval_set
    loss_sum = tokens = 0.0
    for index in range(eval_set.steps):
        rows = eval_set.source.rows(index, 0, eval_set.batch_size)
        with jax.set_mesh(single.ctx.mesh):
            logits = forward(params, router, (rows["inputs"], rows["positions"], rows["segments"]))
        logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
        nll = -np.take_along_axis(np.asarray(logp), rows["targets"][..., None], -1)[..., 0]
        loss_sum += float((nll * rows["weights"]).sum())
        tokens += float(rows["weights"].sum())
    step, result = run.evals[-1]
    assert step == 4 and result["eval_tokens"] == tokens
    np.testing.assert_allclose(result["eval_loss"], loss_sum / tokens, rtol=1e-5)
    np.testing.assert_allclose(result["eval_perplexity"], np.exp(loss_sum / tokens), rtol=1e-5)


def test_evaluation_changes_no_parameter_and_no_optimizer_state(evaluated):
    run = evaluated["run"]
    before = _snapshot(run.state)
    result = run.evaluator.evaluate(run.state)
    after = _snapshot(run.state)  # would raise had the eval step donated the state
    for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)  # bitwise
    # The same state evaluates to the same number: nothing carries over between evaluations.
    assert result["eval_loss"] == run.evals[-1][1]["eval_loss"]


def test_training_losses_are_identical_with_and_without_evaluation(evaluated):
    with_eval = [(m["step"], m["loss"], m["grad_norm"]) for m in evaluated["history"]]
    without = [(m["step"], m["loss"], m["grad_norm"]) for m in evaluated["plain"]]
    assert with_eval == without  # bitwise
    assert evaluated["run"].evals[-1][1]["eval_loss"] < evaluated["run"].evals[0][1]["eval_loss"]


def test_eval_step_runs_no_collective_and_one_reduction_per_evaluation(evaluated):
    evaluator = evaluated["run"].evaluator
    step_hlo = evaluator.compiled.as_text()
    assert not [op for op in COLLECTIVES if f" {op}(" in step_hlo or f"{op}-start" in step_hlo]
    with jax.set_mesh(evaluator.ctx.mesh):
        final = evaluator.finalize_fn.lower(evaluator.zeros_fn()).compile().as_text()
    assert "all-reduce" in final


@pytest.mark.parametrize(
    "layout",
    [
        {"shard_optimizer_over_data": "true"},  # ZeRO-1: data-sharded masters, gathered
        {"ici_fsdp_parallelism": "2"},
        {"shard_mode": "auto"},
    ],
    ids=["zero1", "fsdp", "auto"],
)
def test_other_layouts_evaluate_to_the_same_loss(evaluated, corpus, layout):
    # Initial states (same seed) on the plain data-parallel layout and on `layout`.
    plain = run_lib.setup(_config(corpus))
    plain.evaluator.compiled = evaluated["run"].evaluator.compiled
    other = run_lib.setup(_config(corpus, **layout))
    want = plain.evaluator.evaluate(plain.state)["eval_loss"]
    np.testing.assert_allclose(other.evaluator.evaluate(other.state)["eval_loss"], want, rtol=1e-5)


def _on_step(writer):
    return lambda step, step_metrics: writer.write(step_metrics)


def _reuse_executables(run, compiled):
    """The module's compiled train and eval steps: a restored state must fit them as is."""
    run.compiled, run.evaluator.compiled = compiled.compiled, compiled.evaluator.compiled


def _evals(evals):
    return [(step, r["eval_loss"], r["eval_tokens"]) for step, r in evals]


def test_a_run_killed_during_evaluation_resumes_and_evaluates_again(evaluated, corpus, tmp_path):
    reference = evaluated["run"]
    config = _config(corpus, tmp_path)

    def start(run):
        _reuse_executables(run, reference)
        return metrics.MetricsWriter(config.run_dir, start_step=run.start_step, tensorboard=False)

    first = run_lib.setup(config)
    batch = first.evaluator.batch

    def die_at_second_batch(index):
        if index == 1:
            raise Killed
        return batch(index)

    first.evaluator.batch = die_at_second_batch
    with start(first) as writer, pytest.raises(Killed):
        run_lib.train(first, _on_step(writer), writer.write_eval)
    assert first.evals == []  # nothing of the half-done evaluation was kept
    ckpt = Path(checkpoint_files.checkpoint_dir(config))
    assert sorted(p.name for p in ckpt.iterdir()) == ["2"]  # saved before evaluating

    restarted = run_lib.setup(config)
    assert restarted.start_step == 2
    with start(restarted) as writer:
        history = run_lib.train(restarted, _on_step(writer), writer.write_eval)
    assert _evals(restarted.evals) == _evals(reference.evals)  # bitwise, at steps 2 and 4
    assert [m["loss"] for m in history] == [m["loss"] for m in evaluated["history"][2:]]
    # A finished run started again evaluates its last step again; the file keeps one of each.
    again = run_lib.setup(config)
    with start(again) as writer:
        run_lib.train(again, _on_step(writer), writer.write_eval)
    text = Path(config.run_dir, "metrics.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    written = [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in lines if "eval_loss" in r]
    assert written == _evals(reference.evals)
    assert [r["step"] for r in lines if "learning/loss" in r] == [1, 2, 3, 4]


def test_a_stop_request_skips_the_evaluation_and_the_resumed_run_does_it(
    evaluated, corpus, tmp_path
):
    reference = evaluated["run"]
    config = _config(corpus, tmp_path)
    first = run_lib.setup(config)
    _reuse_executables(first, reference)

    def sigterm_at_2(step, step_metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    run_lib.train(first, sigterm_at_2)
    assert first.stop_reason.startswith("SIGTERM: stopped after step 2") and first.evals == []
    resumed = run_lib.setup(config)
    _reuse_executables(resumed, reference)
    assert resumed.start_step == 2
    run_lib.train(resumed)
    assert _evals(resumed.evals) == _evals(reference.evals)


def test_synthetic_runs_evaluate_a_held_out_stream():
    config = make_config({"eval_interval": "5", "eval_steps": "3"})
    eval_set = eval_data.make_eval_set(config, 8, mesh_shape(config, 8))
    assert eval_set.steps == 3 and eval_set.batch_size == 8
    held_out = eval_set.source.rows(0, 0, 8)["inputs"]
    assert np.array_equal(held_out, eval_set.source.rows(0, 0, 8)["inputs"])  # fixed batches
    for step in range(50):  # none of the first 50 training batches
        assert not np.array_equal(
            held_out, synthetic_batch(config.model, config.training, config.data, 8, step)["inputs"]
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"eval_dataset_path": "/nonexistent/eval"}, r"eval_dataset_path='/nonexistent/eval'"),
        ({"eval_dataset_path": "EMPTY_DIR"}, r"directory eval_dataset_path=.* holds no .txt"),
        ({"eval_dataset_path": "EMPTY_FILE"}, r"eval_dataset_path=.*: 1 files hold no text"),
        ({"eval_dataset_path": ""}, r"dataset_type=text needs eval_dataset_path="),
        ({"eval_per_device_batch_size": "0.5"}, r"eval batch of 4 sequences .*8 batch shards"),
        ({"eval_per_device_batch_size": "0.3"}, r"eval_per_device_batch_size=0.3 x 8 devices"),
        ({"eval_per_device_batch_size": "-1"}, r"eval_per_device_batch_size=-1.0 must be >= 0"),
        ({"dataset_type": "synthetic", "dataset_path": ""}, r"eval_dataset_path=.* is set but"),
        (
            {"dataset_type": "synthetic", "dataset_path": "", "eval_dataset_path": ""},
            r"eval_steps=-1 means the whole eval set",
        ),
    ],
)
def test_bad_eval_input_stops_before_building_the_model(
    corpus, tmp_path, monkeypatch, overrides, message
):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    paths = {"EMPTY_DIR": str(tmp_path / "empty"), "EMPTY_FILE": str(tmp_path / "empty.txt")}
    overrides = {k: paths.get(v, v) for k, v in overrides.items()}

    def no_model(*args, **kwargs):
        raise AssertionError("model built before the eval keys were checked")

    monkeypatch.setattr(
        run_lib.model_lib, "init", no_model
    )  # allocating: after resolve's abstract define
    with pytest.raises(ConfigError, match=message):
        run_lib.setup(_config(corpus, **overrides))


def test_evaluation_off_needs_no_eval_data(corpus):
    config = _config(corpus, eval_interval="0", eval_dataset_path="")
    assert eval_data.make_eval_set(config, 8, {"data": 8, "fsdp": 1, "expert": 1}) is None
    assert not eval_schedule.due(config.training, config.evaluation, config.steps)


def test_plot_draws_the_eval_curve_beside_the_training_loss(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    records = [{"step": s, "learning/loss": 5.0 - s} for s in (1, 2, 3, 4)]
    records[1]["eval_loss"], records[3]["eval_loss"] = 4.5, 2.5
    drawn = []
    original = plt.Axes.plot

    def spy(ax, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(args[1])))
        return original(ax, *args, **kwargs)

    plt.Axes.plot = spy
    try:
        plots.plot([("run", records)], str(tmp_path))
    finally:
        plt.Axes.plot = original
    assert ("run", [4.0, 3.0, 2.0, 1.0]) in drawn and ("run eval", [4.5, 2.5]) in drawn


def test_eval_line_format():
    line = evaluate.eval_line(
        12, {"eval_loss": 2.0, "eval_perplexity": 7.389, "eval_tokens": 4096, "eval_time_s": 0.1}
    )
    assert line == "eval  step    12  loss 2.0000  perplexity 7.39  tokens 4,096  100 ms"
