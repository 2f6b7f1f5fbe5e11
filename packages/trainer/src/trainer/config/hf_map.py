"""config.json <-> trainer Config: every Hugging Face key mapped, checked or refused.

docs/hf.md has the table in words; `KEY_KINDS` is the same table as data (a test
holds the two together). A key in none of the groups below is refused with a
ConfigError naming it: nothing in a config.json is silently ignored. A key left
out takes transformers' default for the model type (`HF_DEFAULTS`, transformers
5.24's DeepseekV3Config / DeepseekV2Config), never a trainer preset's; a key
transformers' modeling code ignores (`IGNORED_BY_HF`: V3's scoring_func) is
ignored here too, and `hf.notes` says so at startup.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.config.config import Config
from trainer.config.keys import ConfigError

MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
# Model types with another's layout: Kimi-K2 is DeepSeek-V3's architecture under
# its own name (transformers reads Kimi's text model as deepseek_v3 too).
ALIASES = {"kimi_k2": "deepseek_v3"}

# HF key -> trainer key, the value carried over unchanged (both directions).
# The routing keys (scoring_func, topk_method, norm_topk_prob, n_group, topk_group)
# are read through `_routing`: what transformers computes for the model type, not
# always what the key says; rope_interleave is always true for V2.
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
    "q_lora_rank",  # null <-> 0 (plain query projection); absent: transformers' 1536
    "rope_theta",  # <-> rope_max_timescale (an integer)
    "rope_scaling",  # <-> rope_type, rope_factor, ... (the official spelling, with `type`)
    "rope_parameters",  # transformers 5's spelling of rope_theta + rope_scaling
    "num_nextn_predict_layers",  # MTP layers in the files; read when mtp_num_layers > 0
    "quantization_config",  # fp8 block scales: dequantized on import
    "model_type",  # deepseek_v3 / kimi_k2 (sigmoid + bias) or deepseek_v2 (softmax)
    "aux_loss_alpha",  # x MoE layers -> load_balance_loss_weight (with seq_aux)
    "seq_aux",  # DeepSeek's sequence-wise balance loss: the trainer's
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
# Not part of the model: token ids, loader hints, file dtypes. Read and dropped;
# export keeps the source's (`hf.export_config`).
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
# transformers 5.24's defaults (configuration_deepseek_v3.py / _v2.py) for the keys
# the import reads and a config.json may leave out. None is transformers' None.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "first_k_dense_replace": 3,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_interleave": True,
        "q_lora_rank": 1536,
        "rope_theta": 10_000,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,  # num_mtp_layers
    },
    "deepseek_v2": {
        "first_k_dense_replace": 0,
        "n_shared_experts": 2,
        "n_group": None,
        "topk_group": None,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "q_lora_rank": 1536,
        "rope_theta": 10_000,
        "num_key_value_heads": None,
        "num_nextn_predict_layers": 0,  # not a V2 key: no MTP layers
    },
}
# What transformers' modeling code computes whatever these keys say: V3 always
# scores with sigmoid and picks with noaux_tc; V2 always uses softmax, never
# renormalizes the top-k weights and always rotates interleaved pairs.
IGNORED_BY_HF: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "deepseek_v2": {"scoring_func": "softmax", "norm_topk_prob": False, "rope_interleave": True},
}
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")  # transformers' V2 router has these two
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
# transformers builds the q and kv latent norms (q_a_layernorm, kv_a_layernorm)
# with its RMSNorm's default epsilon, whatever rms_norm_eps says (which the
# decoder and final norms use): Moonlight's rms_norm_eps is 1e-5.
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
            hf = json.load(f)
    except ValueError as err:
        raise ConfigError(f"{path}: not JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return hf


def trainer_keys_of_directory(directory: str, text_data: bool = False) -> dict[str, Any]:
    """Trainer keys for HF `directory`: its config.json's model keys, and (for a run
    on text data) its tokenizer.json as tokenizer_path when there is one."""
    out = from_hf(read_config_json(directory), os.path.join(directory, "config.json"))
    tokenizer = os.path.join(directory, "tokenizer.json")
    if text_data and os.path.isfile(tokenizer):
        out["tokenizer_path"] = tokenizer
    return out


def family_of(hf: dict, where: str = "config.json") -> str:
    """The transformers family whose layout and math `hf` describes (kimi_k2 ->
    deepseek_v3); ConfigError for any other model_type."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not one of {MODEL_TYPES}")
    return ALIASES.get(model_type, model_type)


def value_of(hf: dict, key: str, family: str, where: str = "config.json") -> Any:
    """config.json's `key`, or transformers' default for `family` when absent. A null
    is transformers' None: refused where its default is not None (its code needs a value)."""
    if key not in hf:
        return HF_DEFAULTS[family].get(key)
    if hf[key] is None and HF_DEFAULTS[family].get(key) is not None:
        raise ConfigError(f"{where}: {key} is null (transformers' {family} needs a value)")
    return hf[key]


def _rope_dict(hf: dict) -> tuple[str, dict]:
    """(key name, dict) of the rope settings: rope_scaling wins over rope_parameters,
    as in transformers; rope_theta inside wins over the top-level key."""
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key):
            return key, dict(hf[key])
    return "rope_scaling", {}


def rope_keys(hf: dict, family: str, where: str) -> dict[str, Any]:
    """Every trainer rope key from rope_theta + rope_scaling, or rope_parameters,
    with transformers' defaults where they are left out (never a preset's)."""
    name, scaling = _rope_dict(hf)
    theta = scaling.pop("rope_theta", None)
    theta = value_of(hf, "rope_theta", family, where) if theta is None else theta
    if theta != int(theta):
        raise ConfigError(f"{where}: rope_theta={theta} is not an integer (rope_max_timescale)")
    out: dict[str, Any] = {"rope_max_timescale": int(theta), "rope_type": "default"}
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind == "default":
        if scaling:
            raise ConfigError(f"{where}: rope key {sorted(scaling)[0]} with default RoPE")
        return out
    if kind != "yarn":
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (default or yarn)")
    for key in scaling:
        if key not in YARN_KEYS and key not in ("mscale", "mscale_all_dim"):
            raise ConfigError(f"{where}: YaRN key {key} is not supported")
    if "factor" not in scaling:
        # transformers raises KeyError: "Missing required keys ... {'factor'}".
        raise ConfigError(f"{where}: {name} has rope type yarn but no factor")
    max_positions = value_of(hf, "max_position_embeddings", family, where)
    # transformers fills original_max_position_embeddings with max_position_embeddings.
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling["factor"]
    if factor is None:  # transformers: the ratio of the two contexts
        factor = max_positions / original
    out.update(
        rope_type="yarn",
        rope_factor=float(factor),
        original_max_position_embeddings=int(original),
        # transformers: `get("beta_fast") or 32`, `get("beta_slow") or 1`.
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        rope_truncate=bool(scaling.get("truncate", True)),
    )
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        out.update(
            mscale=float(mscale), mscale_all_dim=float(mscale_all_dim), rope_attention_scaling=False
        )
    else:
        # transformers then scales cos/sin by m(factor, 1) and leaves the softmax alone.
        out.update(mscale=0.0, mscale_all_dim=0.0, rope_attention_scaling=True)
    return out


def _check_fixed(hf: dict, family: str, where: str) -> None:
    for key, value in FIXED.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {value!r})")
    heads = hf["num_attention_heads"]
    kv_heads = value_of(hf, "num_key_value_heads", family, where)
    if kv_heads is not None and kv_heads != heads:
        said = (
            "=" if "num_key_value_heads" in hf else f" is missing: transformers' {family} default"
        )
        raise ConfigError(
            f"{where}: num_key_value_heads{said} {kv_heads} is not num_attention_heads={heads} "
            "(MLA has one kv head per query head)"
        )
    # V3 refuses a head_dim other than qk_rope_head_dim; V2 overwrites it.
    if family == "deepseek_v3" and hf.get("head_dim") not in (None, hf["qk_rope_head_dim"]):
        raise ConfigError(f"{where}: head_dim={hf['head_dim']} must be {hf['qk_rope_head_dim']}")
    if family == "deepseek_v2" and hf["hidden_size"] % heads:
        # transformers' DeepseekV2Config.validate_architecture raises on this.
        raise ConfigError(
            f"{where}: hidden_size={hf['hidden_size']} is not a multiple of "
            f"num_attention_heads={heads} (transformers refuses it for deepseek_v2)"
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


def _routing(hf: dict, family: str, where: str) -> dict[str, Any]:
    """The router transformers' modeling code builds for `family` (see IGNORED_BY_HF)."""
    value = lambda key: value_of(hf, key, family, where)  # noqa: E731
    if family == "deepseek_v3":
        return dict(
            routed_score_func="sigmoid",
            routed_topk_method="noaux_tc",
            n_routing_groups=value("n_group"),
            topk_routing_group=value("topk_group"),
            norm_topk_prob=bool(value("norm_topk_prob")),
        )
    method = value("topk_method")
    if method not in V2_TOPK_METHODS:
        raise ConfigError(f"{where}: topk_method={method!r} is not one of {V2_TOPK_METHODS}")
    groups = (1, 1)  # greedy picks over all experts: transformers ignores the groups
    if method == "group_limited_greedy":
        for key in ("n_group", "topk_group"):
            if value(key) is None:
                raise ConfigError(f"{where}: {key} is missing (group_limited_greedy needs it)")
        groups = (value("n_group"), value("topk_group"))
    return dict(
        routed_score_func="softmax",
        routed_topk_method=method,
        n_routing_groups=groups[0],
        topk_routing_group=groups[1],
        norm_topk_prob=False,
        # V2 has no routing bias to train (deepseek2-lite's preset does the same).
        routed_bias_update_rate=0.0,
    )


def num_moe_layers(hf: dict, family: str) -> int:
    """MoE layers of the main model (every layer from first_k_dense_replace on)."""
    first_dense = value_of(hf, "first_k_dense_replace", family, "config.json")
    return hf["num_hidden_layers"] - first_dense


def balance_weight(hf: dict, family: str) -> float | None:
    """load_balance_loss_weight equal to DeepSeek's aux_loss_alpha with seq_aux (None:
    no such loss). DeepSeek adds each MoE layer's sequence-wise loss x alpha; the
    trainer adds the weight x their mean, so the weight is alpha x the MoE layers.
    seq_aux defaults to true, as in DeepSeek's configuration_deepseek.py."""
    alpha = hf.get("aux_loss_alpha") or 0.0
    if not alpha or not hf.get("seq_aux", True):
        return None
    return float(alpha) * num_moe_layers(hf, family)


def from_hf(hf: dict, where: str = "config.json") -> dict[str, Any]:
    """Trainer config overrides for a HF config dict (`where` names it in errors)."""
    family = family_of(hf, where)
    for key in hf:
        if key not in KEY_KINDS:
            raise ConfigError(f"{where}: key {key} is not supported (see docs/hf.md)")
    for key in REQUIRED:
        if hf.get(key) is None:
            raise ConfigError(f"{where}: {key} is missing")
    _check_fixed(hf, family, where)
    check_quantization(hf, where)
    routing = _routing(hf, family, where)
    # Read apart: the routing keys (`_routing`) and rope_interleave (V2: always).
    apart = ("norm_topk_prob", "scoring_func", "topk_method", "n_group", "topk_group")
    apart += ("rope_interleave",)
    out: dict[str, Any] = {
        trainer_key: value_of(hf, key, family, where)
        for key, trainer_key in DIRECT.items()
        if key not in apart
    }
    out.update(routing)
    v3_interleave = family == "deepseek_v3" and value_of(hf, "rope_interleave", family, where)
    out["rope_interleave"] = family == "deepseek_v2" or bool(v3_interleave)
    out["latent_norm_epsilon"] = LATENT_NORM_EPS
    q_lora_rank = hf.get("q_lora_rank", HF_DEFAULTS[family]["q_lora_rank"])
    out["q_lora_rank"] = q_lora_rank or 0
    out.update(rope_keys(hf, family, where))
    weight = balance_weight(hf, family)
    if weight is not None:
        out["load_balance_loss_weight"] = weight
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
        if config.norm_topk_prob:
            raise ConfigError(
                "norm_topk_prob=true with softmax routing has no deepseek_v2 equivalent to "
                "export to (transformers' V2 never renormalizes the top-k weights)"
            )
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
    latent_eps = config.latent_norm_epsilon
    latent_eps = latent_eps if latent_eps >= 0 else config.normalization_layer_epsilon
    if latent_eps != LATENT_NORM_EPS:
        raise ConfigError(
            f"latent_norm_epsilon={config.latent_norm_epsilon} (normalization_layer_epsilon="
            f"{config.normalization_layer_epsilon}) cannot be exported: transformers uses "
            f"{LATENT_NORM_EPS} for the MLA latent norms"
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
    if config.load_balance_loss_weight and config.num_moe_layers:
        hf["aux_loss_alpha"] = config.load_balance_loss_weight / config.num_moe_layers
        hf["seq_aux"] = True
    if fp8:
        hf["quantization_config"] = dict(FP8, activation_scheme="dynamic")
    return hf
