"""Issue 46: dropped tokens, capacity everywhere, router z-loss (tag-safe), expert counts,
the checkpoint startup line, MoE figures in records, TensorBoard and the step line."""

import types

import jax
import numpy as np
import pytest

import hlo_tools
from trainer.config import ConfigError, make_config
from trainer.config.validate import validate
from trainer.io import checkpoint, metrics
from trainer.run import report
from trainer.run.run import data_lines, moe_figures, step_line
from trainer.sharding import ShardCtx, logical_rules, make_mesh

DEFERRED = dict(gradient_accumulation_steps="4", gradient_reduction_policy="deferred")
LAYOUTS = {
    "data": dict(ici_data_parallelism="8"),  # local experts path
    "data+expert": dict(ici_data_parallelism="4", ici_expert_parallelism="2"),  # all-to-all
}
CAP, Z = dict(capacity_factor="0.5"), dict(moe_z_loss_coeff="0.01")


def _in_loop_traffic(text: str) -> dict:
    return {k: (r["count"], r["bytes_per_step"]) for k, r in hlo_tools.traffic(
        hlo_tools.parse(text))["in_loop"].items()}  # fmt: skip


# Both layouts in the slow tier (3 compiles each, ~50 s of the cpu tier's 15 minutes):
# the cpu tier checks drops and the router z-loss in moe_kernels' test_moe_capacity.py,
# and the trainer's evaluation lowering with the z-loss on in test_pipeline.py.
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data", "data+expert"])
def test_drops_and_z_loss_add_no_in_loop_collective(layout, runner):
    """capacity_factor and moe_z_loss_coeff on, GA=4, deferred: drops and the z-loss
    reported; the loss grows by exactly coeff x layers x z; every gradient still
    reduced once per step, and the loop runs the plain run's collectives (the
    z-loss adds none; the cap only shrinks the all-to-all blocks)."""
    base = {**LAYOUTS[layout], **DEFERRED}
    plain, plain_text = runner(1, **base)
    capped, capped_text = runner(1, **base, **CAP)
    both, text = runner(1, **base, **CAP, **Z)
    m = both[0]
    assert "dropped_share" not in plain[0] and "router_z_loss" not in plain[0]
    shares = np.asarray(m["dropped_share"])
    assert shares.shape == (2,) and np.all(shares > 0.05) and np.all(shares < 1), shares
    assert m["router_z_loss"] > 0
    # tagtrain-tiny has 2 MoE layers; the z-loss adds coeff x their sum.
    np.testing.assert_allclose(
        m["loss"] - capped[0]["loss"], 0.01 * 2 * m["router_z_loss"], rtol=1e-3
    )
    np.testing.assert_allclose(m["dropped_share"], capped[0]["dropped_share"], rtol=1e-6)
    outside = hlo_tools.assert_reduced_once_per_step(text)
    assert sum(c.elements for c in outside) > 10_000
    # The z-loss adds nothing to the loop; the cap keeps its collectives (a smaller
    # all-to-all with expert parallelism: blocks of 16 rows instead of 64).
    assert _in_loop_traffic(text) == _in_loop_traffic(capped_text)
    capped_loop, plain_loop = _in_loop_traffic(capped_text), _in_loop_traffic(plain_text)
    assert {k: n for k, (n, _) in capped_loop.items()} == {k: n for k, (n, _) in plain_loop.items()}
    assert all(capped_loop[k][1] <= plain_loop[k][1] for k in plain_loop)


def test_record_scalars_and_step_line_show_moe_figures():
    step = {
        "step": 3, "loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3, "tokens_per_s": 10.0,
        "step_time_s": 0.5, "tokens_per_expert": [[2, 2, 2, 2], [1, 1, 1, 5]],
        "dropped_share": [0.0, 0.25], "router_z_loss": 3.5,
        "routing_bias": metrics.bias_stats([[0.0, 1.0, -1.0, 0.0], [2.0, 2.0, 2.0, 2.0]]),
    }  # fmt: skip
    rec = metrics.record(step)
    assert rec["moe/dropped_share_per_layer"] == [0.0, 0.25]
    assert rec["moe/dropped_share"] == 0.125
    assert rec["learning/router_z_loss"] == 3.5
    assert rec["moe/routing_bias"]["min"] == [-1.0, 2.0]
    assert rec["moe/routing_bias"]["std"][1] == 0.0
    tb = metrics.scalars(rec)
    assert tb["moe/dropped_share/layer_1"] == 0.25 and tb["moe/dropped_share"] == 0.125
    assert tb["moe/routing_bias/layer_0/max"] == 1.0
    assert tb["moe/load_imbalance/layer_1"] == 2.5
    line = step_line(3, step)
    assert "imbalance 2.50  dropped 12.50%  z 3.500" in line, line
    assert "  ce " not in line  # no ce_loss in this record: nothing to split
    # issue #55: the loss includes the balance loss; the line shows the cross-entropy
    # (what transformers' and TRL's loss is) and the auxiliary terms apart.
    with_ce = step_line(3, {**step, "loss": 6.2428, "ce_loss": 6.2405}, aux=True)
    assert "loss 6.2428  ce 6.2405  aux 0.0023  imbalance" in with_ce
    # No cap, no z-loss: only the imbalance; a dense model: nothing.
    plain = {k: v for k, v in step.items() if k not in ("dropped_share", "router_z_loss")}
    assert moe_figures(plain) == "  imbalance 2.50"
    assert moe_figures({"loss": 1.0}) == ""


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"num_experts": "6", "ici_expert_parallelism": "8", "ici_data_parallelism": "1"},
         r"^num_experts=6 is not divisible by ici_expert_parallelism=8 .*nearest that fit: 8, 16$"),
        ({"num_experts": "12", "ici_expert_parallelism": "8", "ici_data_parallelism": "1"},
         r"nearest that fit: 8, 16$"),
        # n_routing_groups=2 folds in: 6 on expert=4 -> multiples of 4 (and 2).
        ({"num_experts": "6", "ici_expert_parallelism": "4", "ici_data_parallelism": "2"},
         r"nearest that fit: 4, 8$"),
        ({"moe_z_loss_coeff": "-0.1"}, r"^moe_z_loss_coeff=-0.1 must be >= 0"),
    ],
)  # fmt: skip
def test_bad_moe_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(overrides), 8)


@pytest.mark.parametrize("enable", [True, False])
@pytest.mark.parametrize("directory", [True, False])
def test_checkpoint_startup_line_for_every_combination(enable, directory, tmp_path):
    overrides = {"enable_checkpointing": str(enable).lower()}
    if directory:
        overrides["base_output_directory"] = str(tmp_path)
    config = make_config(overrides)
    checkpoints = checkpoint.open_checkpointer(config, 8)
    try:
        run = types.SimpleNamespace(
            config=config, checkpoints=checkpoints, source=None, evaluator=None,
            restored_from="", initialized_from="",
        )  # fmt: skip
        (line,) = data_lines(run)
    finally:
        if checkpoints:
            checkpoints.close()
    if enable and directory:
        assert line.startswith(f"checkpoints: {tmp_path}"), line
    elif enable:
        assert line == "checkpoints: off (set base_output_directory=DIR to save and resume)"
    elif directory:
        assert line.startswith("checkpoints: off (enable_checkpointing=false: set it to true")
        assert str(tmp_path) in line
    else:
        assert line.startswith("checkpoints: off (enable_checkpointing=false and no base_output")
    assert (checkpoints is not None) == (enable and directory)


@pytest.mark.parametrize(
    "overrides,want",
    [
        (dict(ici_data_parallelism="8", capacity_factor="1.25"),
         "caps each of the 8 experts at 10 of a token shard's 64 assignments"),
        (dict(ici_data_parallelism="4", ici_expert_parallelism="2", capacity_factor="1.25"),
         "at 40 rows of a token shard's 64 assignments (fair share 64/2 = 32)"),
        (dict(ici_data_parallelism="4", ici_expert_parallelism="2"),
         "padded to all 64 assignments of a token shard"),
        (dict(ici_data_parallelism="8"), None),
    ],
)  # fmt: skip
def test_capacity_startup_line_says_what_the_cap_means(overrides, want):
    config = make_config({"per_device_batch_size": "1", **overrides})
    devices = jax.devices()[:8]
    sizes = validate(config, len(devices))
    mesh = make_mesh(sizes, config.shard_mode, devices)
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)
    lines = report.capacity_lines(config, ctx, global_batch=8)
    if want is None:
        assert lines == []
    else:
        (line,) = lines
        assert want in line, line


def test_plot_metrics_draws_the_moe_charts(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.io import plots

    with metrics.MetricsWriter(str(tmp_path / "run"), tensorboard=False) as writer:
        for step in range(1, 6):
            writer.write({
                "step": step, "loss": 3.0, "tokens_per_expert": [[4, 4, 4, 4], [step, 1, 1, 1]],
                "dropped_share": [0.0, 0.1 * step],
                "routing_bias": metrics.bias_stats([[0.0] * 4, [-0.01 * step, 0, 0, 0.01]]),
            })  # fmt: skip
    shown = []
    original = plt.Axes.imshow

    def spy(ax, data, *args, **kwargs):
        shown.append(np.asarray(data))
        return original(ax, data, *args, **kwargs)

    plt.Axes.imshow = spy
    try:
        assert plots.main([str(tmp_path / "run"), "--output_dir", str(tmp_path / "p")]) == 0
    finally:
        plt.Axes.imshow = original
    for name in (
        "load_balance.png", "load_balance_per_layer.png", "dropped_tokens.png",
        "routing_bias.png", "expert_load_run.png",
    ):  # fmt: skip
        png = (tmp_path / "p" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    # One heat map per layer, experts x steps, each cell load / the layer's mean.
    assert [a.shape for a in shown] == [(4, 5), (4, 5)]
    np.testing.assert_allclose(shown[0], 1.0)
    np.testing.assert_allclose(shown[1][0], [s / ((s + 3) / 4) for s in range(1, 6)])


@pytest.mark.parametrize(
    "layout",
    [
        dict(ici_data_parallelism="1", ici_fsdp_parallelism="4", ici_expert_parallelism="2",
             expert_shard_attention_option="context"),
        dict(ici_data_parallelism="4", ici_expert_parallelism="2", shard_mode="auto"),
    ],
    ids=["fsdp+expert(context)", "data+expert-auto"],
)  # fmt: skip
@pytest.mark.slow  # three more compiles; the cpu tier keeps the tag-safety test above
def test_z_loss_matches_one_device(layout, runner):
    """The router z-loss on a sequence-sharded residual and in auto mode equals one
    device's (the per-token z is laid out like the loss weights before they meet)."""
    (ref,), _ = runner(1, devices=1, **Z)
    (m,), _ = runner(1, **layout, **Z)
    np.testing.assert_allclose(m["router_z_loss"], ref["router_z_loss"], rtol=1e-4)
    np.testing.assert_allclose(m["loss"], ref["loss"], rtol=1e-4)
