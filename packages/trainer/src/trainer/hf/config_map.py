"""config.json <-> trainer Config: every Hugging Face key mapped, checked or refused.

docs/hf.md has the table in words; `KEY_KINDS` is the same table as data (a test
holds the two together). A key in none of the groups below is refused with a
ConfigError naming it: nothing in a config.json is silently ignored.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.config import Config, ConfigError

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")

# HF key -> trainer key, the value carried over unchanged (both directions).
DIRECT = {
    "vocab_size": "vocab_size",
    "hidden_size": "base_emb_dim",
    "intermediate_size": "base_mlp_dim",
    "moe_intermediate_size": "base_moe_mlp_dim",
    "num_hidden_layers": "base_num_decoder_layers",
    "first_k_dense_replace": "first_num_dense_layers",
    "num_attention_heads": "base_num_query_heads",
    "n_routed_experts": "num_experts",
    "n_shared_experts": "shared_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "n_group": "n_routing_groups",
    "topk_group": "topk_routing_group",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "scoring_func": "routed_score_func",
    "topk_method": "routed_topk_method",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "normalization_layer_epsilon",
    "rope_interleave": "rope_interleave",
}
# Mapped with a conversion (see `from_hf` / `to_hf`).
CONVERTED = (
    "q_lora_rank",  # null <-> 0 (plain query projection)
    "rope_theta",  # <-> rope_max_timescale (an integer)
    "rope_scaling",  # <-> rope_type, rope_factor, ... (the official spelling, with `type`)
    "rope_parameters",  # transformers 5's spelling of rope_theta + rope_scaling
    "num_nextn_predict_layers",  # MTP layers in the files; read when mtp_num_layers > 0
    "quantization_config",  # fp8 block scales: dequantized on import
    "model_type",  # deepseek_v3 (sigmoid + bias) or deepseek_v2 (softmax)
)
# Keys the trainer implements one value of: any other value is refused.
FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "moe_layer_freq": 1,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
}
# Checked against the keys they derive from (MLA has one kv head per query head;
# transformers writes head_dim = qk_rope_head_dim and qk_head_dim = nope + rope).
DERIVED = ("num_key_value_heads", "head_dim", "qk_head_dim")
# Not part of the model: the original run's training settings, token ids, loader
# hints, file dtypes. Read and dropped; export writes its own.
INFORMATIONAL = (
    "architectures",
    "auto_map",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "transformers_version",
    "use_cache",
    "output_router_logits",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "torch_dtype",
    "dtype",
    "_name_or_path",
)
KEY_KINDS = {
    **{k: "direct" for k in DIRECT},
    **{k: "converted" for k in CONVERTED},
    **{k: "fixed" for k in FIXED},
    **{k: "derived" for k in DERIVED},
    **{k: "informational" for k in INFORMATIONAL},
}
# Each family's value where its config.json leaves a key out (transformers' defaults).
FAMILY_DEFAULTS = {
    "deepseek_v3": dict(
        routed_score_func="sigmoid",
        routed_topk_method="noaux_tc",
        rope_interleave=True,
        norm_topk_prob=True,
    ),
    "deepseek_v2": dict(
        routed_score_func="softmax",
        routed_topk_method="greedy",
        rope_interleave=True,
        norm_topk_prob=False,
        # V2 has no routing bias to train (deepseek2-lite's preset does the same).
        routed_bias_update_rate=0.0,
    ),
}
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# transformers hard-codes this epsilon for the q and kv latent norms; the trainer
# has one epsilon for every norm, so other rms_norm_eps values would differ there.
LATENT_NORM_EPS = 1e-6
# YaRN keys of rope_scaling / rope_parameters -> trainer keys.
YARN_KEYS = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "truncate": "rope_truncate",
}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def read_config_json(directory: str) -> dict:
    """config.json of a HF directory; ConfigError naming the file when unreadable."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: not found (hf_model_path must be a Hugging Face directory)")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as err:
        raise ConfigError(f"{path}: not JSON ({err})") from None


def trainer_keys_of_directory(directory: str, text_data: bool = False) -> dict[str, Any]:
    """Trainer keys for HF `directory`: its config.json's model keys, and (for a run
    on text data) its tokenizer.json as tokenizer_path when there is one."""
    out = from_hf(read_config_json(directory), os.path.join(directory, "config.json"))
    tokenizer = os.path.join(directory, "tokenizer.json")
    if text_data and os.path.isfile(tokenizer):
        out["tokenizer_path"] = tokenizer
    return out


def _rope(hf: dict, where: str) -> dict[str, Any]:
    """Trainer rope keys from rope_theta + rope_scaling, or rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10_000))
    if theta != int(theta):
        raise ConfigError(f"{where}: rope_theta={theta} is not an integer (rope_max_timescale)")
    out: dict[str, Any] = {"rope_max_timescale": int(theta)}
    scaling = {**scaling, **params}
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind == "default":
        if scaling:
            raise ConfigError(f"{where}: rope key {sorted(scaling)[0]} with default RoPE")
        return out
    if kind != "yarn":
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (default or yarn)")
    out["rope_type"] = "yarn"
    mscale, mscale_all_dim = scaling.pop("mscale", None), scaling.pop("mscale_all_dim", None)
    if mscale and mscale_all_dim:
        out.update(mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))
    else:
        # transformers then scales cos/sin by m(factor, 1) and leaves the softmax alone.
        out.update(mscale=0.0, mscale_all_dim=0.0, rope_attention_scaling=True)
    for key, value in scaling.items():
        if key not in YARN_KEYS:
            raise ConfigError(f"{where}: YaRN key {key} is not supported")
        out[YARN_KEYS[key]] = value
    return out


def _check_fixed(hf: dict, where: str) -> None:
    for key, value in FIXED.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {value!r})")
    heads = hf["num_attention_heads"]
    expected = {
        "num_key_value_heads": heads,
        "head_dim": hf["qk_rope_head_dim"],
        "qk_head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
    }
    for key, value in expected.items():
        if hf.get(key) not in (None, value):
            raise ConfigError(f"{where}: {key}={hf[key]} must be {value} for this model")
    if hf.get("rms_norm_eps", LATENT_NORM_EPS) != LATENT_NORM_EPS:
        raise ConfigError(
            f"{where}: rms_norm_eps={hf['rms_norm_eps']} is not supported: transformers "
            f"uses {LATENT_NORM_EPS} for the latent norms and the trainer one epsilon for all"
        )


def check_quantization(hf: dict, where: str) -> bool:
    """True for DeepSeek's fp8 block format; ConfigError for any other quantization."""
    quant = hf.get("quantization_config")
    if not quant:
        return False
    for key, value in FP8.items():
        if quant.get(key, value) != value:
            raise ConfigError(
                f"{where}: quantization_config {key}={quant[key]!r} is not supported ({value!r})"
            )
    return True


def from_hf(hf: dict, where: str = "config.json") -> dict[str, Any]:
    """Trainer config overrides for a HF config dict (`where` names it in errors)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not one of {MODEL_TYPES}")
    for key in hf:
        if key not in KEY_KINDS:
            raise ConfigError(f"{where}: key {key} is not supported (see docs/hf.md)")
    for key in REQUIRED:
        if hf.get(key) is None:
            raise ConfigError(f"{where}: {key} is missing")
    _check_fixed(hf, where)
    check_quantization(hf, where)
    if model_type == "deepseek_v2" and hf.get("rope_interleave", True) is not True:
        raise ConfigError(f"{where}: rope_interleave=false is not a deepseek_v2 layout")
    out: dict[str, Any] = dict(FAMILY_DEFAULTS[model_type])
    out.update({DIRECT[k]: v for k, v in hf.items() if k in DIRECT and v is not None})
    out["q_lora_rank"] = hf.get("q_lora_rank") or 0
    out.update(_rope(hf, where))
    # MTP stays a choice (mtp_num_layers): the files' MTP layers are read when it is on.
    return out


def model_type_of(config: Config) -> str:
    """The transformers family that computes what `config` computes."""
    family = (config.routed_score_func, config.routed_topk_method)
    if family == ("sigmoid", "noaux_tc"):
        return "deepseek_v3"
    if config.routed_score_func == "softmax" and config.routed_topk_method != "noaux_tc":
        if not config.rope_interleave:
            raise ConfigError("rope_interleave=false has no deepseek_v2 equivalent to export to")
        return "deepseek_v2"
    raise ConfigError(
        f"routed_score_func={config.routed_score_func} with routed_topk_method="
        f"{config.routed_topk_method} has no transformers equivalent to export to"
    )


def _rope_scaling(config: Config) -> dict | None:
    """The official rope_scaling dict (None for plain RoPE)."""
    if config.rope_type != "yarn":
        return None
    mscale = config.mscale
    mscale_all_dim = mscale if config.mscale_all_dim < 0 else config.mscale_all_dim
    scaling = {
        "type": "yarn",
        "factor": config.rope_factor,
        "original_max_position_embeddings": config.original_max_position_embeddings,
        "beta_fast": config.beta_fast,
        "beta_slow": config.beta_slow,
    }
    if not config.rope_truncate:
        scaling["truncate"] = False
    if config.rope_attention_scaling and not (mscale or mscale_all_dim):
        return scaling  # transformers' meaning of no mscale keys
    if config.rope_attention_scaling or not (mscale and mscale_all_dim):
        raise ConfigError(
            f"mscale={mscale}, mscale_all_dim={mscale_all_dim}, rope_attention_scaling="
            f"{str(config.rope_attention_scaling).lower()} have no transformers equivalent"
        )
    return dict(scaling, mscale=mscale, mscale_all_dim=mscale_all_dim)


def to_hf(config: Config, *, fp8: bool = False) -> dict:
    """config.json for `config` (what transformers' DeepseekV3/V2 classes read)."""
    model_type = model_type_of(config)
    if config.normalization_layer_epsilon != LATENT_NORM_EPS:
        raise ConfigError(
            f"normalization_layer_epsilon={config.normalization_layer_epsilon} cannot be "
            f"exported: transformers uses {LATENT_NORM_EPS} for the latent norms"
        )
    hf: dict[str, Any] = {
        "architectures": [
            "DeepseekV3ForCausalLM" if model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"
        ],
        "model_type": model_type,
        **{hf_key: getattr(config, key) for hf_key, key in DIRECT.items()},
        **FIXED,
        "num_key_value_heads": config.base_num_query_heads,
        "q_lora_rank": config.q_lora_rank or None,
        "rope_theta": config.rope_max_timescale,
        "rope_scaling": _rope_scaling(config),
        "num_nextn_predict_layers": getattr(config, "mtp_num_layers", 0),
        "torch_dtype": config.weight_dtype,
    }
    if model_type == "deepseek_v2":
        del hf["rope_interleave"]  # always interleaved; not a V2 key
    if fp8:
        hf["quantization_config"] = dict(FP8, activation_scheme="dynamic")
    return hf
