"""DeepSeek-V3's and V2-Lite's published tensor lists map one-to-one onto the presets.

The tensor names and shapes are derived here from the published config.json files
(tests/fixtures/hf_configs/, no weights) the way transformers and DeepSeek name
them, fp8 block scales and the multi-token-prediction layer included; the trainer
side is the preset's abstract parameter tree. Nothing is missing, nothing is left
over but the MTP layer (skipped until MTP is on).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer import hf
from trainer import model as model_lib
from trainer.config import hf_map, make_config
from trainer.hf import keys, safetensors, stream

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"
CASES = (("deepseek_v3.json", "deepseek3-671b"), ("deepseek_v2_lite.json", "deepseek2-lite"))


def _attention(c: dict) -> dict[str, tuple[int, ...]]:
    h, d = c["num_attention_heads"], c["hidden_size"]
    k = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = {
        "self_attn.kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], d),
        "self_attn.kv_a_layernorm.weight": (c["kv_lora_rank"],),
        "self_attn.kv_b_proj.weight": (
            h * (c["qk_nope_head_dim"] + c["v_head_dim"]),
            c["kv_lora_rank"],
        ),
        "self_attn.o_proj.weight": (d, h * c["v_head_dim"]),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    if c["q_lora_rank"]:
        out["self_attn.q_a_proj.weight"] = (c["q_lora_rank"], d)
        out["self_attn.q_a_layernorm.weight"] = (c["q_lora_rank"],)
        out["self_attn.q_b_proj.weight"] = (h * k, c["q_lora_rank"])
    else:
        out["self_attn.q_proj.weight"] = (h * k, d)
    return out


def _moe(c: dict) -> dict[str, tuple[int, ...]]:
    d, f, e = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    fs = f * c["n_shared_experts"]
    out = {"mlp.gate.weight": (e, d)}
    if c["model_type"] == "deepseek_v3":
        out["mlp.gate.e_score_correction_bias"] = (e,)
    for i in range(e):
        out |= {
            f"mlp.experts.{i}.gate_proj.weight": (f, d),
            f"mlp.experts.{i}.up_proj.weight": (f, d),
            f"mlp.experts.{i}.down_proj.weight": (d, f),
        }
    return out | {
        "mlp.shared_experts.gate_proj.weight": (fs, d),
        "mlp.shared_experts.up_proj.weight": (fs, d),
        "mlp.shared_experts.down_proj.weight": (d, fs),
    }


def published_tensors(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of the published files."""
    d, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    mtp = c.get("num_nextn_predict_layers", 0)
    dense_mlp = {
        "mlp.gate_proj.weight": (c["intermediate_size"], d),
        "mlp.up_proj.weight": (c["intermediate_size"], d),
        "mlp.down_proj.weight": (d, c["intermediate_size"]),
    }
    shapes = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    for i in range(layers + mtp):
        per = _attention(c) | (dense_mlp if i < c["first_k_dense_replace"] else _moe(c))
        if i >= layers:  # DeepSeek-V3's MTP module
            per |= {
                "embed_tokens.weight": (v, d),
                "enorm.weight": (d,),
                "hnorm.weight": (d,),
                "eh_proj.weight": (d, 2 * d),
                "shared_head.norm.weight": (d,),
                "shared_head.head.weight": (v, d),
            }
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in per.items()}
    fp8 = bool(c.get("quantization_config"))
    out = {}
    for name, shape in shapes.items():
        quantized = fp8 and name.startswith("model.layers.") and name.endswith("proj.weight")
        if quantized and ".mlp.gate." not in name and "eh_proj" not in name:
            out[name] = (shape, "F8_E4M3")
            scales = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            out[name + "_scale_inv"] = (scales, "F32")
        else:
            out[name] = (shape, "F32" if "e_score_correction_bias" in name else "BF16")
    return out


@pytest.mark.parametrize(("file", "preset"), CASES)
def test_published_tensors_map_one_to_one_onto_the_preset(file, preset):
    published = json.loads((CONFIGS / file).read_text())
    tensors = published_tensors(published)
    config = make_config({"model_name": preset})
    ctx = hf.default_ctx(config)
    params, router = model_lib.abstract_state(model_lib.define(config.model, ctx), ctx)
    leaves = keys.leaves({"params": params, "router": router}, config, published["model_type"])
    refs = {
        name: safetensors.TensorRef(name, file, safetensors.DTYPES[dtype], shape, 0)
        for name, (shape, dtype) in tensors.items()
    }
    plan = stream.check(leaves, refs, config.base_num_decoder_layers, file)
    layers = published["num_hidden_layers"]
    mtp = {n for n in tensors if keys.layer_index(n) is not None and keys.layer_index(n) >= layers}
    assert set(plan.skipped) == mtp
    assert len(mtp) == (1 if published["model_type"] == "deepseek_v3" else 0) * len(
        [n for n in tensors if n.startswith(f"model.layers.{layers}.")]
    )
    # Every trainer element comes from exactly one tensor: the leaves' element counts
    # equal the mapped tensors' (scales and the MTP layer aside).
    mapped = {n for n in tensors if n not in mtp and not n.endswith("_scale_inv")}
    present = [leaf for leaf in leaves if not leaf.optional]  # V2: no routing bias
    assert mapped == {name for leaf in present for _, name in leaf.names()}
    trainer_elements = sum(math.prod(leaf.shape) for leaf in present)
    assert trainer_elements == sum(math.prod(tensors[n][0]) for n in mapped)
    # And config.json itself maps onto the preset's model (the balance-loss weight,
    # V2-Lite's aux_loss_alpha, is a training choice the preset leaves at 0).
    from_hf = hf_map.from_hf(published)
    from_hf.pop("load_balance_loss_weight", None)
    # The import's explicit latent epsilon is what the preset's -1 means (its one 1e-6).
    assert from_hf.pop("latent_norm_epsilon") == config.normalization_layer_epsilon
    assert config.latent_norm_epsilon < 0
    assert {k: getattr(config, k) for k in from_hf} == {
        k: getattr(make_config(from_hf), k) for k in from_hf
    }
