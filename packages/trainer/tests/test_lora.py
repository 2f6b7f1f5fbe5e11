"""LoRA (lora_rank > 0): a frozen base from a Hugging Face directory, trained adapters.

One compile for the module: a tiny DeepSeek-V3 with MTP (fixture v3_sharded_mtp) on
8 devices (data=8), adapters on every target group, GA=2 with deferred reduction. The
run is killed after step 2, resumed, and compared with an uninterrupted one; its last
checkpoint is exported with export-hf and the merged weights checked against the
adapted forward.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_tools
from trainer import data as data_lib
from trainer import hf
from trainer import model as model_lib
from trainer.config import ConfigError, lora_targets, make_config
from trainer.config.validate import validate
from trainer.io import export_hf
from trainer.model import flops, lora
from trainer.run import report
from trainer.run import run as run_lib
from trainer.run.spec import resolve_abstract
from trainer.step.loss import token_cross_entropy
from trainer.step.train_step import mtp_loss_scales

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "v3_sharded_mtp"
LORA = {
    "hf_model_path": str(FIXTURE),
    "mtp_num_layers": "1",
    "dtype": "float32",
    "lora_rank": "4",
    "lora_alpha": "8",
    "lora_targets": "attention,mlp,experts,shared_experts",
    "gradient_accumulation_steps": "2",
    "gradient_reduction_policy": "deferred",
    "per_device_batch_size": "1",
    "steps": "3",
    "async_checkpointing": "false",
    "checkpoint_period": "1",
    "max_checkpoints_to_keep": "3",
}


class Killed(Exception):
    """Stands in for the process dying right after a step."""


def _config(out, **overrides):
    values = {**LORA, **overrides}
    if out is not None:
        values["base_output_directory"] = str(out)
    return make_config(values)


def _host(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def _equal(a, b) -> None:
    jax.tree.map(np.testing.assert_array_equal, _host(a), _host(b))


def _forwards(run) -> dict:
    """Step 0's forward: main and MTP logits of the adapted model (initial adapters)
    and of the base model alone, and the base model's loss on batch 0 (before the
    first step donates the state)."""
    config, ctx, state = run.config, run.ctx, run.state
    base_model = model_lib.define(_config(None, lora_rank="0").model, ctx)
    batch = run_lib.batch_for(run, 0)

    def logits(model, adapters):
        return model_lib.apply_with_mtp(
            model, state["frozen"], state["router"], batch, lambda lg, t, w: (lg, t, w),
            adapters=adapters,
        )  # fmt: skip

    def base_loss(base):
        # make_loss_fn's formula: main cross-entropy sum plus each depth's sum scaled by
        # mtp_loss_scales, over the batch's target weight.
        (main, _), depths, _ = base
        weights = batch["weights"]
        total = jnp.sum(token_cross_entropy(main, batch["targets"]) * weights)
        scale_D = mtp_loss_scales(config.model, batch, ctx)
        for k, (lg, targets, w) in enumerate(depths):
            total = total + jnp.sum(token_cross_entropy(lg, targets) * w * scale_D[k])
        return total / jnp.sum(weights)

    def all_three(adapters):
        # One program for the three (a compile each cost the module's fixture ~6 s):
        # the adapted and the base forward are still two separate computations in it,
        # the adapted one through its adapters (B = 0), and the loss is the base's.
        base = logits(base_model, None)
        return logits(run.model, adapters), base, base_loss(base)

    with jax.set_mesh(ctx.mesh):
        adapted, base, loss = jax.jit(all_three)(state["params"])
    return {"adapted": _host(adapted), "base": _host(base), "base_loss": float(loss)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    first = run_lib.setup(_config(out))
    initial = _host(first.state)
    forwards = _forwards(first)
    compiled = run_lib.compile_step(first)
    startup = run_lib.startup_lines(first)

    def die_after_2(step, metrics):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        run_lib.train(first, die_after_2)
    restarted = run_lib.setup(_config(out))
    restarted.compiled = compiled  # the same executable: restored shardings must match it
    resumed = run_lib.train(restarted)
    reference = run_lib.setup(_config(None))
    reference.compiled = compiled
    return dict(
        out=out,
        initial=initial,
        forwards=forwards,
        compiled=compiled,
        startup=startup,
        restarted=restarted,
        resumed=resumed,
        reference=reference,
        history=run_lib.train(reference),
    )


def _adapter_count(state) -> int:
    return sum(x.size for x in jax.tree.leaves(state["params"]))


def test_step_0_is_the_base_model(runs):
    forwards = runs["forwards"]
    # B starts at zero: the adapted forward is the base model's, bit for bit.
    _equal(forwards["adapted"], forwards["base"])
    # And the first step's loss is the base model's loss on that batch.
    first_loss = runs["history"][0]["loss"]
    np.testing.assert_allclose(first_loss, forwards["base_loss"], rtol=1e-6)


def test_only_the_adapters_are_trained(runs):
    state, initial = runs["reference"].state, runs["initial"]
    adapters = state["params"]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)]
    assert names and all(n.endswith(("_lora_a']", "_lora_b']")) for n in names)
    # Every target group got adapters, stacked over its layers.
    ffn = adapters["moe_layers"]["ffn"]
    assert ffn["wi_0_lora_a"].shape[:2] == (2, 8)  # (MoE layers, experts, D, r)
    assert {"shared_wo_lora_b", "wo_lora_b"} <= set(ffn)
    assert {"wq_a_DxQ_lora_a", "wkv_b_CxHxNV_lora_b"} <= set(adapters["mtp"]["block"]["attn"])
    # Optimizer state for the adapters alone (Adam's moments shaped like them).
    mu = next(n.mu for n in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu"))
              if hasattr(n, "mu"))  # fmt: skip
    assert jax.tree.structure(mu) == jax.tree.structure(adapters)
    # The base is bitwise the Hugging Face weights after 3 steps; B moved off zero.
    # The routing biases too (issue #55: they drifted, so an adapter alone could not
    # reproduce the run): frozen under LoRA unless lora_update_routing_bias.
    _equal(state["frozen"], initial["frozen"])
    _equal(state["router"], initial["router"])
    assert runs["reference"].config.routed_bias_update_rate > 0  # would have moved them
    _, expected = hf.load(str(FIXTURE), dtype="float32", mtp_num_layers=1, progress=False)
    _equal(state["frozen"], expected["params"])
    moved = np.asarray(adapters["dense_layers"]["attn"]["wo_HxVxD_lora_b"])
    assert np.abs(moved).max() > 0 and not np.asarray(initial["params"]["dense_layers"]["attn"][
        "wo_HxVxD_lora_b"]).any()  # fmt: skip


def test_the_step_reduces_adapter_gradients_only_once_per_step(runs):
    text = runs["compiled"].as_text()
    module = hlo_tools.parse(text)
    # Nothing gradient-sized inside the microbatch loop (GA=2), one reduction after it.
    hlo_tools.assert_reduced_once_per_step(module)
    outside = hlo_tools.gradient_reductions_outside(module)
    # Reduced with them: the loss sums (scalars) and the experts' token counts (int).
    arrays = [a for c in outside for a in c.arrays if a.dims and a.dtype == "f32"]
    # Exactly the adapters' gradient elements are reduced: none of the base's.
    assert sum(a.elements for a in arrays) == _adapter_count(runs["reference"].state)
    # The startup summary says so.
    head = next(line for line in runs["startup"] if line.startswith("collectives per step"))
    assert "OK" in head and "gradient_reduction_policy=deferred" in head
    mib = _adapter_count(runs["reference"].state) * 4 / report.MIB
    assert f"({mib:.3f} MiB)" in head
    lora_line = next(line for line in runs["startup"] if line.startswith("lora:"))
    assert "rank 4, alpha 8 (scale 2)" in lora_line and "expert_wi_0" in lora_line
    assert f"{mib:.3f} MiB: the gradient the step reduces" in lora_line


def test_resume_is_exact(runs):
    restarted = runs["restarted"]
    assert restarted.start_step == 2 and "frozen base (LoRA)" in restarted.initialized_from
    losses = [(m["step"], m["loss"], m["grad_norm"]) for m in runs["resumed"]]
    reference = [(m["step"], m["loss"], m["grad_norm"]) for m in runs["history"]]
    assert losses == reference[2:]  # bitwise on CPU
    _equal(restarted.state["params"], runs["reference"].state["params"])
    _equal(restarted.state["opt_state"], runs["reference"].state["opt_state"])
    # The checkpoints hold the adapters, optimizer state, router biases, step: no base.
    saved = sorted(
        p.name for p in (Path(restarted.checkpoints.directory) / "3" / "state").iterdir()
    )
    assert "frozen" not in " ".join(saved)


def test_export_writes_the_merged_weights(runs, tmp_path):
    restarted = runs["restarted"]
    out = tmp_path / "merged"
    assert export_hf.main([f"run_dir={restarted.config.run_dir}", f"output={out}"]) == 0
    config, trees = hf.load(str(out), dtype="float32", progress=False)
    assert config.lora_rank == 0
    state, ctx = restarted.state, restarted.ctx
    rows = np.random.default_rng(0).integers(0, config.vocab_size, (8, 16))
    exported = np.asarray(hf.forward(config, trees, rows))
    tokens = jax.device_put(
        jnp.asarray(rows, jnp.int32), data_lib.batch_shardings(ctx, 8, 16)["inputs"]
    )
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (8, 16))
    with jax.set_mesh(ctx.mesh):
        positions = jax.device_put(positions, tokens.sharding)
        segments = jax.device_put(jnp.ones((8, 16), jnp.int32), tokens.sharding)
        adapted, _ = jax.jit(
            lambda s: model_lib.apply(
                restarted.model, s["frozen"], s["router"], tokens, positions, segments,
                adapters=s["params"],
            )
        )(state)  # fmt: skip
    np.testing.assert_allclose(exported, np.asarray(adapted), atol=2e-5, rtol=1e-5)
    # An adapted weight is W + alpha/r A @ B, the others are the base's.
    merged = model_lib.merged(restarted.model, state["frozen"], state["params"])
    wo = merged["dense_layers"]["attn"]["wo_HxVxD"]
    a = state["params"]["dense_layers"]["attn"]["wo_HxVxD_lora_a"]
    b = state["params"]["dense_layers"]["attn"]["wo_HxVxD_lora_b"]
    want = state["frozen"]["dense_layers"]["attn"]["wo_HxVxD"] + 2.0 * jnp.einsum(
        "lhvr,lrd->lhvd", a, b
    )
    np.testing.assert_allclose(np.asarray(wo), np.asarray(want), rtol=1e-6, atol=1e-7)
    _equal(merged["embedding_VxD"], state["frozen"]["embedding_VxD"])
    # The routed experts' adapters have no PEFT form: adapter=true says so, one line.
    args = [f"run_dir={restarted.config.run_dir}", f"output={tmp_path / 'adapter'}"]
    assert export_hf.main([*args, "adapter=true"]) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lora_targets": "attention,qproj"}, "unknown target 'qproj'"),
        ({"lora_targets": "attention,q_proj"}, "'q_proj' selects nothing here (q_lora_rank=32"),
        ({"lora_targets": "wq"}, "'wq' is not in this model (q_lora_rank=32"),
        ({"lora_targets": "wq_a", "q_lora_rank": "0"}, "'wq_a' is not in this model"),
        ({"lora_targets": "experts", "first_num_dense_layers": "3"}, "no MoE layer"),
        ({"lora_targets": "shared_wo", "shared_experts": "0"}, "shared_experts=0"),
        ({"lora_targets": " , "}, "names no target"),
        ({"lora_rank": "-1"}, "lora_rank=-1 must be >= 0"),
        ({"lora_alpha": "0"}, "lora_alpha=0.0 must be > 0"),
        (
            {"gradient_accumulation_schedule": "overlapped"},
            "gradient_accumulation_schedule=overlapped does not run with lora_rank=4",
        ),
    ],
)
def test_bad_lora_settings_are_config_errors(overrides, message):
    config = make_config({"lora_rank": "4", **overrides})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(config, 8)


def test_a_misspelt_target_is_refused_with_lora_off_too():
    with pytest.raises(ConfigError, match="unknown target 'experts_wo'"):
        validate(make_config({"lora_targets": "experts_wo"}), 8)


def test_targets_resolve_groups_to_the_model_s_projections():
    model = make_config({"lora_rank": "2", "q_lora_rank": "0"}).model
    assert lora_targets.resolve_targets(model) == {"wq", "wkv_a", "wkv_b", "wo"}
    model = make_config({"lora_rank": "2", "lora_targets": "experts,wo"}).model
    assert lora_targets.resolve_targets(model) == {"expert_wi_0", "expert_wi_1", "expert_wo", "wo"}
    assert lora.spec_of(make_config({}).model) is None  # lora_rank=0: off


def test_training_flops_drop_the_base_weight_gradients():
    def parts(**overrides):
        config = make_config({"lora_rank": "4", **overrides})
        adapters = resolve_abstract(config).trained  # the adapters: what LoRA trains
        count = sum(x.size for x in jax.tree.leaves(adapters))
        return config.model, count, flops.training_flops_per_token(config.model, config.data)

    full_config = make_config({})
    attention = flops.training_flops_per_token(full_config.model, full_config.data)
    attention -= 6 * flops.active_matmul_params(full_config.model)
    n = flops.active_matmul_params(full_config.model)
    # Attention adapters: each factor element is used once per token (every layer).
    _, count, total = parts()
    assert total == 4 * n + 6 * count + attention
    # Routed experts: a token goes through k of E experts; their kernels' gradient is
    # formed (the merged layer), 2 flops per kernel element a token touches.
    model, count, total = parts(lora_targets="experts")
    k, e, d, f = model.num_experts_per_tok, model.num_experts, model.emb_dim, model.base_moe_mlp_dim
    merged = 2 * model.num_moe_layers * k * 3 * d * f
    assert total == 4 * n + merged + 6 * count * k / e + attention
