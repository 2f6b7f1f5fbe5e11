"""LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors, what
`PeftModel.from_pretrained(base, dir)` loads over the base transformers model.

PEFT's LoRA on an nn.Linear of weight [out, in] computes
    y = x W^T + (lora_alpha / r) (x lora_A^T) lora_B^T
(lora_A.weight [r, in], lora_B.weight [out, r])
and saves the factors as `base_model.model.<module>.lora_A.weight` / `lora_B.weight`
(`<module>` the transformers module's name, e.g. model.layers.0.self_attn.q_a_proj).
The trainer's factors of a kernel W (in..., out...) are A (in..., r) and B (r, out...)
with the same scale lora_alpha / r, so lora_A = A flattened to [in, r], transposed,
and lora_B = B flattened to [r, out], transposed: the input and output dims flatten
in the order `trainer.hf.keys` flattens the kernel itself.

Only the attention projections are written (q_proj, q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj): PEFT 0.21 on transformers 5's DeepseekV3
turns every gate_proj / up_proj / down_proj target into a `target_parameters`
adapter of the fused routed experts (DeepseekV3Experts.gate_up_proj, down_proj, one
rank-r*E factor pair per layer), so the dense MLP and the shared experts cannot be
named at all, and the experts' adapters have another shape than the trainer's per
expert pairs. Adapters there, and routing biases a run updated
(lora_update_routing_bias), are refused naming them: export the merged weights. The
multi-token-prediction blocks' adapters are left out: transformers does not build
those layers.
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from trainer.config import Config, ConfigError, hf_map
from trainer.hf import keys, safetensors
from trainer.model.lora import A_SUFFIX, B_SUFFIX

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _flat(tree: dict, prefix: tuple = ()) -> dict[tuple[str, ...], object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _nest(flat: dict[tuple[str, ...], object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _pairs(config: Config, adapters: dict, params: dict) -> list[tuple[keys.Leaf, object, object]]:
    """(the adapted kernel's Leaf, A, B) of each adapted weight outside the MTP blocks
    (`params`: the base tree, arrays or ShapeDtypeStructs, for the kernels' shapes);
    ConfigError for an adapter PEFT cannot hold."""
    flat, base_flat = _flat(adapters), _flat(params)
    kernels, factors = {}, {}
    for path, a in flat.items():
        if not path[-1].endswith(A_SUFFIX) or path[0] == "mtp":
            continue
        base = path[:-1] + (path[-1].removesuffix(A_SUFFIX),)
        b = flat[base[:-1] + (base[-1] + B_SUFFIX,)]
        kernels[base] = jax.ShapeDtypeStruct(base_flat[base].shape, np.float32)
        factors[base] = (a, b)
    family = hf_map.to_hf(config)["model_type"]
    out = []
    for leaf in keys.leaves({"params": _nest(kernels)}, config, family):
        if ".self_attn." not in leaf.template:
            name = leaf.template.removeprefix("model.layers.{i}.").removesuffix(".weight")
            raise ConfigError(
                f"{name}: a PEFT adapter holds the attention projections' adapters only "
                "(PEFT 0.21 maps gate_proj / up_proj / down_proj onto transformers 5's fused "
                "routed experts): export the merged weights instead (export-hf without adapter=)"
            )
        out.append((leaf, *factors[leaf.path]))
    return out


def module_names(config: Config, adapters: dict, params: dict) -> list[str]:
    """PEFT's `target_modules`: the adapted modules' names (q_a_proj, kv_b_proj ...),
    each a name only the attention's Linear modules carry."""
    names = set()
    for leaf, _, _ in _pairs(config, adapters, params):
        names.add(leaf.template.removesuffix(".weight").split(".")[-1])
    return sorted(names)


def _tensors(config: Config, adapters: dict, params: dict):
    """(PEFT name, producer, shape, dtype) of every factor, file order."""
    for leaf, a, b in _pairs(config, adapters, params):
        a_host, b_host = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        ins = math.prod(leaf.tensor_shape[: leaf.in_dims])
        r = a_host.shape[-1]
        for lead, name in leaf.names():
            module = PREFIX + name.removesuffix(".weight")
            lora_a = a_host[lead].reshape(ins, r).T.astype(np.float32)
            lora_b = b_host[lead].reshape(r, -1).T.astype(np.float32)
            yield module + ".lora_A.weight", lambda x=lora_a: x, lora_a.shape, lora_a.dtype
            yield module + ".lora_B.weight", lambda x=lora_b: x, lora_b.shape, lora_b.dtype


def adapter_config(config: Config, adapters: dict, params: dict, base: str | None) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for these adapters (no dropout,
    no bias, plain alpha / r scaling, every layer)."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": config.lora_rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": module_names(config, adapters, params),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def save_adapter(
    path: str, config: Config, adapters: dict, params: dict, base: str | None = None
) -> None:
    """Write `adapters` (a LoRA run's trained factors) to `path` as a PEFT adapter
    directory over the base model `base` (its path, written as base_model_name_or_path);
    `params`: the base's parameter tree (arrays or ShapeDtypeStructs: only shapes read).
    ConfigError, before anything is written, for what PEFT cannot hold."""
    if not config.lora_rank:
        raise ConfigError("a PEFT adapter export needs a LoRA run (lora_rank > 0)")
    if config.lora_update_routing_bias and config.routed_bias_update_rate:
        raise ConfigError(
            "lora_update_routing_bias=true: the run changed the routing biases, which a "
            "PEFT adapter cannot hold: export the merged weights instead"
        )
    entries = list(_tensors(config, adapters, params))
    held = os.path.join(path, WEIGHTS)
    if os.path.exists(held):
        raise ConfigError(f"{held} exists: export into a new directory")
    os.makedirs(path, exist_ok=True)
    safetensors.write_file(held, entries)
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(adapter_config(config, adapters, params, base), f, indent=2, sort_keys=True)
        f.write("\n")


def read_adapter(path: str, config: Config, like: dict, params: dict) -> dict:
    """The trainer's factors, shaped as `like` (a LoRA model's adapter tree: arrays or
    ShapeDtypeStructs; `params` the base tree's shapes), from a PEFT adapter directory:
    the inverse of save_adapter (host f32 arrays; MTP blocks' factors, which PEFT does
    not hold, zero)."""
    refs = safetensors.read_header(os.path.join(path, WEIGHTS))
    flat = {p: np.zeros(v.shape, np.float32) for p, v in _flat(like).items()}
    for leaf, _, _ in _pairs(config, like, params):
        a_out = flat[leaf.path[:-1] + (leaf.path[-1] + A_SUFFIX,)]
        b_out = flat[leaf.path[:-1] + (leaf.path[-1] + B_SUFFIX,)]
        for lead, name in leaf.names():
            module = PREFIX + name.removesuffix(".weight")
            for suffix in (".lora_A.weight", ".lora_B.weight"):
                if module + suffix not in refs:
                    raise ConfigError(f"{path}/{WEIGHTS}: no tensor {module + suffix}")
            lora_a = np.asarray(refs[module + ".lora_A.weight"].array(), np.float32)
            lora_b = np.asarray(refs[module + ".lora_B.weight"].array(), np.float32)
            a_out[lead] = lora_a.T.reshape(a_out[lead].shape)
            b_out[lead] = lora_b.T.reshape(b_out[lead].shape)
    return _nest(flat)
