"""LoRA the PEFT way: transformers' module names as targets, PEFT's lora_alpha, and the
adapter-only export (hf/peft.py) against what PEFT 0.21.2 itself wrote.

fixtures/hf/v3_chat_peft (make_peft_fixtures.py, `nox -s hf_fixtures`) is a PEFT
LoRA adapter over v3_chat saved by `PeftModel.save_pretrained`: r 2, lora_alpha 8,
target_modules the attention projections, factors drawn nonzero, and the logits
`PeftModel.from_pretrained(v3_chat, dir)` computes for v3_chat's reference tokens.
PEFT's conventions the checks rely on (peft/tuners/lora/layer.py, LoraModel):
- a Linear of weight [out, in] gets lora_A.weight [r, in] and lora_B.weight [out, r]
  and computes x W^T + lora_alpha / r x (x lora_A^T) lora_B^T (use_rslora false);
- the file's keys are `base_model.model.<module name>.lora_A.weight` (adapter name
  dropped); LoraConfig's defaults are r 8, lora_alpha 8, lora_dropout 0, bias none.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import hf
from trainer import model as model_lib
from trainer.config import ConfigError, lora_targets, make_config
from trainer.hf import peft, safetensors

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
BASE, ADAPTER = FIXTURES / "v3_chat", FIXTURES / "v3_chat_peft"
ATTENTION = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"  # transformers' names


def _lora_config(**extra):
    values = {"hf_model_path": str(BASE), "dtype": "float32", "lora_rank": "2"}
    return make_config({**values, "lora_targets": ATTENTION, **extra})


@pytest.fixture(scope="module")
def loaded():
    config = _lora_config()
    ctx = hf.default_ctx(config)
    model = model_lib.define(config.model, ctx)
    trees = hf.import_params(str(BASE), config, ctx, progress=False, model=model)
    like = model_lib.abstract_adapters(model, ctx)
    host = peft.read_adapter(str(ADAPTER), config, like, trees["params"])
    adapters = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), host, like)
    return config, ctx, model, trees, adapters


def test_lora_alpha_defaults_to_peft_s():
    # LoraConfig().lora_alpha == 8 and the scale is lora_alpha / r (not rsLoRA's sqrt).
    config = make_config({"lora_rank": "4"})
    assert config.lora_alpha == 8.0
    assert model_lib.define(config.model, hf.default_ctx(config)).lora_scale == 2.0


def test_transformers_module_names_select_the_trainer_s_projections():
    def chosen(targets, **extra):
        return lora_targets.resolve_targets(
            make_config({"lora_rank": "2", "lora_targets": targets, **extra}).model
        )

    assert chosen(ATTENTION) == {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo"}
    assert chosen("q_proj,kv_b_proj", q_lora_rank="0") == {"wq", "wkv_b"}
    # gate_proj: every Linear of that name in the checkpoint (dense MLP, shared and
    # routed experts, model.layers.{i}.mlp.experts.{e}.gate_proj); all-linear: all.
    assert chosen("gate_proj") == {"mlp_wi_0", "shared_wi_0", "expert_wi_0"}
    everything = chosen("all-linear")
    assert everything == chosen("attention,mlp,experts,shared_experts")
    assert chosen("all-linear,wo") == everything  # a name twice is one target
    with pytest.raises(ConfigError, match="'q_proj' selects nothing here"):
        chosen("q_proj")  # q_lora_rank > 0: transformers has q_a_proj / q_b_proj
    with pytest.raises(ConfigError, match="unknown target 'qkv_proj'"):
        chosen("qkv_proj")


def test_the_trainer_s_forward_with_peft_s_factors_is_peft_s_logits(loaded):
    config, ctx, model, trees, adapters = loaded
    reference = np.load(ADAPTER / "reference.npz")
    tokens = jnp.asarray(reference["tokens"], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    with jax.set_mesh(ctx.mesh):
        logits, _ = jax.jit(
            lambda p, r, a: model_lib.apply(
                model, p, r, tokens, positions, jnp.ones_like(tokens), adapters=a
            )
        )(trees["params"], trees["router"], adapters)
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], atol=1e-4, rtol=1e-4)
    # Without the adapters the logits are v3_chat's: the adapter is what moves them.
    base = np.load(BASE / "reference.npz")["logits"]
    assert np.abs(reference["logits"] - base).max() > 0.1


def test_the_export_is_what_peft_saved(loaded, tmp_path):
    config, _, _, trees, adapters = loaded
    out = tmp_path / "adapter"
    peft.save_adapter(str(out), config, adapters, trees["params"], base=str(BASE))
    theirs = safetensors.read_header(str(ADAPTER / peft.WEIGHTS))
    ours = safetensors.read_header(str(out / peft.WEIGHTS))
    assert sorted(ours) == sorted(theirs)
    for name, ref in theirs.items():
        assert ours[name].shape == ref.shape, name
        np.testing.assert_array_equal(ours[name].array(), ref.array().astype(np.float32))
    written = json.loads((out / peft.CONFIG).read_text())
    saved = json.loads((ADAPTER / peft.CONFIG).read_text())
    for key in ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "use_rslora", "use_dora"):
        assert written[key] == saved[key], key
    assert set(written["target_modules"]) == set(saved["target_modules"])
    assert written["base_model_name_or_path"] == str(BASE)
    with pytest.raises(ConfigError, match="exists: export into a new directory"):
        peft.save_adapter(str(out), config, adapters, trees["params"])


def test_what_a_peft_adapter_cannot_hold_is_refused(tmp_path):
    config = _lora_config(lora_targets="attention,shared_experts")
    ctx = hf.default_ctx(config)
    model = model_lib.define(config.model, ctx)
    params, _ = model_lib.abstract_state(model, ctx)
    adapters = model_lib.abstract_adapters(model, ctx)
    with pytest.raises(ConfigError, match="shared_experts.gate_proj: a PEFT adapter holds"):
        peft.save_adapter(str(tmp_path / "a"), config, adapters, params)
    trained_bias = _lora_config(lora_update_routing_bias="true")
    with pytest.raises(ConfigError, match="lora_update_routing_bias=true"):
        peft.save_adapter(str(tmp_path / "b"), trained_bias, adapters, params)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
