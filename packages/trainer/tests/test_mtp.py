"""Multi-token prediction (model/mtp.py): config errors, the depth targets' masking, the
parameter tree (one embedding, one head), and the train step with MTP on: accumulated
gradients equal full-batch ones and no gradient is reduced inside the microbatch loop.

The cpu tier compiles two steps (explicit ZeRO-1 GA=4 fused with 1 depth and its
single-device full-batch reference; the same with 2 depths is slow); the rest of the
matrix (explicit/auto x ZeRO-1/plain x fused/unfused x 1/2 depths, and the overlapped
reduction) is slow. Auto mode lets XLA place every reduction, with MTP as without it
(benchmarks/results/explicit_auto.md: in the loop on CPU): there the matrix checks the
numbers against one device; deferral is asserted in explicit mode.
"""

import jax
import numpy as np
import pytest

import hlo_tools
from trainer import model as model_lib
from trainer.config import ConfigError, make_config
from trainer.config.validate import validate
from trainer.model import flops
from trainer.model.mtp import depth_targets
from trainer.run.spec import resolve_abstract
from trainer.sharding import ShardCtx, logical_rules, make_mesh

GA4 = {"gradient_accumulation_steps": "4"}
ZERO1 = {"shard_optimizer_over_data": "true"}
UNFUSED = {"gradient_accumulation_schedule": "plain"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mtp_num_layers": "-1"}, "mtp_num_layers=-1 must be >= 0"),
        ({"mtp_num_layers": "32"}, "mtp_num_layers=32 leaves no target token"),
        (
            {"mtp_num_layers": "1", "mtp_eval_target_module": "2"},
            "mtp_eval_target_module=2 must be between 0 (off) and mtp_num_layers=1",
        ),
        ({"mtp_loss_scaling_factor": "-0.1"}, "mtp_loss_scaling_factor=-0.1 must be >= 0"),
    ],
)
def test_bad_mtp_keys_are_one_line_config_errors(overrides, message):
    config = make_config({"model_name": "tagtrain-tiny", **overrides})
    with pytest.raises(ConfigError) as error:
        validate(config, 8)
    assert message in str(error.value) and "\n" not in str(error.value)


def _ctx(config):
    sizes = validate(config, 8)
    return ShardCtx(make_mesh(sizes, "explicit"), logical_rules(config.parallelism), "explicit")


def test_depth_targets_stop_at_documents_and_the_sequence_end():
    config = make_config({"model_name": "tagtrain-tiny", "max_target_length": "8"})
    ctx = _ctx(config)
    # Two rows: one document of 8 targets; documents of 3, 4 and 1 pairs, then padding.
    segments = np.array([[1] * 8, [1, 1, 1, 2, 2, 2, 2, 3]], np.int32)
    weights = np.ones((2, 8), np.float32)
    inputs = np.arange(16, dtype=np.int32).reshape(2, 8)
    batch = {"inputs": inputs, "targets": inputs + 1, "segments": segments, "weights": weights}
    batch = jax.device_put(batch, ctx.sharding(("activation_batch", "activation_length"), (2, 8)))
    with jax.set_mesh(ctx.mesh):
        for k in (1, 2):
            got_inputs, got_targets, got_weights = jax.device_get(depth_targets(batch, k, ctx))
            for row in range(2):
                for i in range(8):
                    inside = i + k < 8 and segments[row, i + k] == segments[row, i]
                    assert got_weights[row, i] == float(inside), (k, row, i)
                    if i + k < 8:
                        # Depth k reads t_{i+k} and predicts t_{i+k+1}.
                        assert got_inputs[row, i] == inputs[row, i + k]
                        assert got_targets[row, i] == inputs[row, i + k] + 1


def test_mtp_parameters_share_the_embedding_and_head():
    config = make_config({"model_name": "tagtrain-tiny", "mtp_num_layers": "2"})
    spec = resolve_abstract(config)
    params, router = model_lib.abstract_state(spec.model, spec.ctx)
    # One embedding table and one output matrix in the whole tree: no copies.
    vocab_sized = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if config.vocab_size in leaf.shape
    ]
    assert vocab_sized == ["['embedding_VxD']", "['logits_DxV']"]
    mtp = params["mtp"]
    d = config.emb_dim
    assert mtp["eh_proj_2xDxD"].shape == (2, 2, d, d)
    for norm in ("enorm", "hnorm", "head_norm"):
        assert mtp[norm]["scale"].shape == (2, d)
    # Each depth's block is one of the later (MoE) layers, with its own router bias.
    block = jax.tree.map(lambda x: x.shape[1:], mtp["block"])
    later = jax.tree.map(lambda x: x.shape[1:], params["moe_layers"])
    assert block == later
    assert router["mtp"]["block"]["ffn"]["bias"].shape == (2, config.num_experts)
    # Counting: MTP's share named apart; the rest is what the model had without it.
    plain = make_config({"model_name": "tagtrain-tiny"})
    plain_spec = resolve_abstract(plain)
    plain_params, _ = model_lib.abstract_state(plain_spec.model, plain_spec.ctx)
    total, own = flops.count_params(params), flops.mtp_param_count(params)
    assert own == flops.count_params(mtp) > 0
    assert total - own == flops.count_params(plain_params)


def _assert_no_gradient_reduction_in_the_loop(text):
    outside = hlo_tools.assert_reduced_once_per_step(text)
    assert sum(c.elements for c in outside) > 10_000  # the gradients, not a scalar


def _assert_first_step_equal(got_history, want_history, got_grads, want_grads):
    for key in ("loss", "ce_loss", "mtp_loss_1", "grad_norm"):
        np.testing.assert_allclose(got_history[0][key], want_history[0][key], rtol=1e-4)
    assert "eh_proj_2xDxD" in "".join(want_grads)  # the MTP leaves are compared too
    for leaf, want in want_grads.items():
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(
            got_grads[leaf], want, rtol=1e-4, atol=1e-6 * scale, err_msg=leaf
        )


@pytest.mark.parametrize("depth", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_accumulated_mtp_gradients_equal_the_full_batch_and_stay_deferred(
    runner, grads_runner, depth
):
    """ZeRO-1, fused accumulation: the shared embedding and head get both uses'
    gradients, accumulated unreduced and reduced once after the loop."""
    mtp = {"mtp_num_layers": depth}
    history, text = runner(1, **mtp, **ZERO1, **GA4)
    reference, _ = runner(1, devices=1, **mtp)
    _assert_first_step_equal(
        history,
        reference,
        grads_runner(1, **mtp, **ZERO1, **GA4),
        grads_runner(1, devices=1, **mtp),
    )
    assert history[0]["loss"] > history[0]["ce_loss"]  # the MTP term is in the loss
    _assert_no_gradient_reduction_in_the_loop(text)


OVERLAP = {"gradient_accumulation_schedule": "overlapped"}
MATRIX = [
    pytest.param(depth, mode, layout, way, marks=pytest.mark.slow, id=f"{depth}-{mode}-{name}-{w}")
    for depth in ("1", "2")
    for mode in ("explicit", "auto")
    for name, layout in (("data", {}), ("zero1", ZERO1))
    for w, way in (("fused", {}), ("unfused", UNFUSED))
] + [
    # The overlapped reduction (last microbatch after the loop): MTP's leaves are
    # reduced right after its backward pass, the stacked layers' inside it.
    pytest.param(depth, "explicit", ZERO1, OVERLAP, marks=pytest.mark.slow, id=f"{depth}-overlap")
    for depth in ("1", "2")
]


@pytest.mark.parametrize(("depth", "mode", "layout", "way"), MATRIX)
def test_mtp_matrix_keeps_one_reduction_per_step(runner, depth, mode, layout, way):
    overrides = {"mtp_num_layers": depth, "shard_mode": mode, **layout, **way, **GA4}
    history, text = runner(1, **overrides)
    if mode == "explicit":
        _assert_no_gradient_reduction_in_the_loop(text)
    reference, _ = runner(1, devices=1, mtp_num_layers=depth)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(history[0][key], reference[0][key], rtol=1e-4)


def test_top1_hits_mark_where_the_target_has_the_largest_logit():
    from trainer.step.loss import top1_hits

    logits = np.array([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]]], np.float32)
    targets = np.array([[1, 2, 2]], np.int32)
    np.testing.assert_array_equal(np.asarray(top1_hits(logits, targets)), [[1.0, 0.0, 1.0]])


def test_mtp_losses_reach_the_record_the_scalars_and_the_plot_lines(tmp_path):
    from trainer.io import metrics, plots
    from trainer.run.evaluate import eval_line
    from trainer.run.run import step_line

    step = {
        "step": 1,
        "loss": 6.6,
        "ce_loss": 6.0,
        "mtp_loss_1": 6.1,
        "mtp_loss_2": 5.9,
        "grad_norm": 1.0,
        "learning_rate": 1e-3,
        "tokens_per_s": 1.0,
        "step_time_s": 1.0,
    }
    line = step_line(1, step)
    assert "loss 6.6000  ce 6.0000  aux 0.6000  mtp 6.1000 5.9000" in line
    rec = metrics.record(step)
    assert rec["learning/mtp_loss_1"] == 6.1 and rec["learning/mtp_loss_2"] == 5.9
    assert metrics.scalars(rec)["learning/mtp_loss_2"] == 5.9
    path = tmp_path / "metrics.jsonl"
    with metrics.MetricsWriter(str(tmp_path), jsonl_path=str(path), tensorboard=False) as w:
        w.write(step)
        result = {"eval_loss": 5.0, "eval_perplexity": 148.4, "eval_tokens": 10}
        result.update({"eval_mtp_acceptance_2": 0.25, "eval_time_s": 0.1})
        w.write_eval(1, result)
    assert "mtp depth 2 acceptance 25.0%" in eval_line(1, result)
    (merged,) = metrics.read(str(path))
    assert merged["eval_mtp_acceptance_2"] == 0.25
    # plot-metrics' MTP chart: one line per depth.
    _, _, key = plots.CHARTS["mtp_loss.png"]
    assert plots._series([merged], key, "run") == [
        ("learning/mtp_loss_1", "run depth 1"),
        ("learning/mtp_loss_2", "run depth 2"),
    ]


@pytest.mark.slow
def test_no_counted_mtp_prediction_sees_the_next_document():
    """Two packed documents in a row: changing the second one's tokens changes no
    depth's loss at a counted position of the first (forward, one device)."""
    from trainer.step.loss import token_cross_entropy

    config = make_config({"model_name": "tagtrain-tiny", "mtp_num_layers": "2"})
    sizes = validate(config, 1)
    ctx = ShardCtx(
        make_mesh(sizes, "explicit", jax.devices()[:1]),
        logical_rules(config.parallelism),
        "explicit",
    )
    model = model_lib.define(config.model, ctx)
    params, router = model_lib.init(ctx, model, config.seed)
    length, first = config.max_target_length, 12
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (1, length + 1))
    segments = np.where(np.arange(length) < first, 1, 2)[None].astype(np.int32)
    positions = np.where(np.arange(length) < first, np.arange(length), np.arange(length) - first)

    def batch(tokens):
        targets = tokens[:, 1:].copy()
        targets[0, first - 1] = 0  # the first document's last input has no target in it
        weights = np.ones((1, length), np.float32)
        weights[0, first - 1] = 0.0
        return {
            "inputs": tokens[:, :-1].astype(np.int32),
            "targets": targets.astype(np.int32),
            "positions": positions[None].astype(np.int32),
            "segments": segments,
            "weights": weights,
        }

    forward = jax.jit(
        lambda p, r, b: model_lib.apply_with_mtp(
            model, p, r, b, lambda lg, t, w: (token_cross_entropy(lg, t), w)
        )[1]
    )
    changed = tokens.copy()
    changed[0, first:] = (changed[0, first:] + 7) % config.vocab_size
    with jax.set_mesh(ctx.mesh):
        before = jax.device_get(forward(params, router, batch(tokens)))
        after = jax.device_get(forward(params, router, batch(changed)))
    for k, ((nll, weights), (nll_after, _)) in enumerate(zip(before, after, strict=True), 1):
        counted = weights[0] > 0
        assert counted[: first - 1 - k].all() and not counted[first - 1 - k : first].any(), k
        np.testing.assert_array_equal(
            nll_after[0, :first][counted[:first]], nll[0, :first][counted[:first]]
        )
        # The second document's own predictions did change: the test can fail.
        assert not np.array_equal(nll_after[0, first:], nll[0, first:])


@pytest.mark.slow
def test_eval_reports_the_target_depths_top1_acceptance():
    """mtp_eval_target_module=2: the share of depth 2's counted positions whose
    argmax is the token 3 ahead, summed over the eval set, as numpy counts it from
    the depth's logits; the eval loss is the one evaluation without it reports."""

    from trainer.run import run as run_lib
    from trainer.run.evaluate import make_evaluator

    values = {
        "model_name": "tagtrain-tiny",
        "dtype": "float32",
        "mtp_num_layers": "2",
        "eval_interval": "1",
        "eval_steps": "2",
        "per_device_batch_size": "1",
        "enable_tensorboard": "false",
    }
    run = run_lib.setup(make_config({**values, "mtp_eval_target_module": "2"}))
    result = run.evaluator.evaluate(run.state)
    plain_config = make_config({**values, "mtp_eval_target_module": "0"})
    plain = make_evaluator(
        plain_config.parallelism,
        plain_config.data,
        plain_config.evaluation,
        run.ctx,
        run.model,
        run.evaluator.eval_set,
    )
    assert "eval_mtp_acceptance_2" not in plain.evaluate(run.state)
    np.testing.assert_allclose(result["eval_loss"], plain.evaluate(run.state)["eval_loss"], 1e-6)

    forward = jax.jit(
        lambda p, r, b: model_lib.apply_with_mtp(
            run.model, p, r, b, lambda lg, t, w: (lg, t, w), 2
        )[1][1]
    )
    hits = counted = 0.0
    with jax.set_mesh(run.ctx.mesh):
        for index in range(run.evaluator.eval_set.steps):
            logits, targets, weights = jax.device_get(
                forward(run.state["params"], run.state["router"], run.evaluator.batch(index))
            )
            hits += float(np.sum((logits.argmax(-1) == targets) * weights))
            counted += float(np.sum(weights))
    assert counted == 2 * 8 * (32 - 2)  # every row a whole sequence: 2 fewer targets
    assert result["eval_mtp_acceptance_2"] == pytest.approx(hits / counted, abs=1e-9)
