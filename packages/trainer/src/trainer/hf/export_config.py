"""What an export writes beside the tensors when it knows the directory the model came
from (the run's hf_model_path): that config.json with only the keys the trainer
changed rewritten, its generation_config.json, and its dtype.

Without a source, config.json is `hf_map.to_hf`'s alone and the tensors keep
the parameters' dtypes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.config import Config, ConfigError, hf_map
from trainer.hf import safetensors

EXPORT_DTYPES = ("float32", "bfloat16")
GENERATION_CONFIG = "generation_config.json"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Rewritten from the trainer's config whenever they differ from the source's meaning.
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
BALANCE_KEYS = ("aux_loss_alpha", "seq_aux")
DTYPE_KEYS = ("torch_dtype", "dtype")
# The safetensors dtypes a source's tensors may be kept in (f16 widens: exact).
FILE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float32"}


def read_source(directory: str | None) -> dict | None:
    """config.json of `directory` (None when there is none to read)."""
    if not directory or not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    return hf_map.read_config_json(directory)


def source_dtype(source: dict, directory: str) -> str:
    """The dtype an export of a model imported from `directory` writes by default:
    the source's own; bfloat16 for DeepSeek's fp8 files (their unquantized tensors'
    dtype); from the embedding's file dtype when config.json does not say."""
    if hf_map.check_quantization(source, "config.json"):
        return "bfloat16"
    for key in DTYPE_KEYS:
        if source.get(key) in EXPORT_DTYPES:
            return source[key]
        if source.get(key) == "float16":
            return "float32"
    try:
        refs = safetensors.read_directory(directory)
    except ConfigError:
        return "float32"
    ref = refs.get("model.embed_tokens.weight")
    dtype = safetensors.NAMES.get(ref.dtype) if ref is not None else None
    return FILE_DTYPES.get(dtype, "float32")


def _rope_of(hf: dict) -> dict:
    """The trainer rope keys a config.json means (compared, not written)."""
    family = hf_map.family_of(hf)
    return hf_map.rope_keys(hf, family, "config.json")


def _meaning_when_absent(key: str, family: str) -> Any:
    """What transformers computes for `family` when config.json leaves `key` out."""
    for table in (
        hf_map.FIXED,
        hf_map.HF_DEFAULTS[family],
        hf_map.IGNORED_BY_HF[family],
    ):
        if key in table:
            return table[key]
    return None


def merge(computed: dict, source: dict | None, config: Config) -> dict:
    """config.json for an export: `source` with the keys whose meaning the trainer's
    `config` changed rewritten from `computed` (hf_map.to_hf), the rest kept as
    the source spells them (token ids, auto_map, Kimi's model_type ...). The source
    is not used when the trainer's config is another model family."""
    if source is None or hf_map.family_of(source) != computed["model_type"]:
        return computed
    family = computed["model_type"]
    out = {k: v for k, v in source.items() if k != "quantization_config"}  # no fp8 written
    for key, value in computed.items():
        if key in ("model_type", "architectures") + ROPE_KEYS + BALANCE_KEYS + DTYPE_KEYS:
            continue  # the source's spelling and names; rope, balance, dtype below
        if key in out and out[key] == value:
            continue
        if key not in out and value == _meaning_when_absent(key, family):
            continue  # the source means this value by leaving the key out
        out[key] = value
    if _rope_of(source) != _rope_of(computed):
        for key in ROPE_KEYS:
            out.pop(key, None)
        out.update({key: computed[key] for key in ("rope_theta", "rope_scaling")})
    if (hf_map.balance_weight(source, family) or 0.0) != config.load_balance_loss_weight:
        out["aux_loss_alpha"] = computed.get("aux_loss_alpha", 0.0)
        out["seq_aux"] = True
    return out


# Why a source key changes, where the reason is not just "the run's config says so".
CHANGE_REASONS = {
    "num_nextn_predict_layers": "no multi-token-prediction layers written: mtp_num_layers=0",
    "quantization_config": "nothing is written in fp8",
    "torch_dtype": "the tensors' dtype",
    "dtype": "the tensors' dtype",
}
_ABSENT = object()


def changes(source: dict | None, written: dict) -> list[str]:
    """One phrase per config.json key an export wrote otherwise than the source held
    (`key old -> new (why)`; removed keys say `removed`), in key order; [] without a
    source. What a user reads to know the export is not the source's config verbatim."""
    if source is None:
        return []
    out = []
    for key in sorted(set(source) | set(written)):
        old, new = source.get(key, _ABSENT), written.get(key, _ABSENT)
        if old == new:
            continue
        old_text = "(absent)" if old is _ABSENT else json.dumps(old)
        new_text = "removed" if new is _ABSENT else json.dumps(new)
        why = CHANGE_REASONS.get(key, "the run's config")
        out.append(f"{key} {old_text} -> {new_text} ({why})")
    return out


def set_dtype(hf: dict, dtype: str) -> dict:
    """`hf` declaring `dtype`, under the key the source used (torch_dtype otherwise)."""
    key = next((k for k in DTYPE_KEYS if k in hf), "torch_dtype")
    return {**{k: v for k, v in hf.items() if k not in DTYPE_KEYS}, key: dtype}


def generation_config(hf: dict, source_dir: str | None) -> dict | None:
    """generation_config.json for an export: the source's as it is, else the token
    ids of `hf` (None when it has none: transformers then uses its own defaults)."""
    if source_dir and os.path.isfile(os.path.join(source_dir, GENERATION_CONFIG)):
        try:
            with open(os.path.join(source_dir, GENERATION_CONFIG)) as f:
                return json.load(f)
        except ValueError as err:
            raise ConfigError(f"{source_dir}/{GENERATION_CONFIG}: not JSON ({err})") from None
    ids = {key: hf[key] for key in TOKEN_IDS if hf.get(key) is not None}
    return {"_from_model_config": True, **ids} if ids else None


def write_json(path: str, value: Any) -> None:
    """`value` as indented JSON with a final newline."""
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
