"""The trainer's MoE keys as moe_kernels' `MoEConfig`: the one mapping.

The model builds its MoE layers from `moe_config` (trainer.model.moe_block), and
`check` builds the same config to validate the keys: moe_kernels owns the routing
rules (experts, top-k, groups, capacity, ...) and refuses a bad value with a
ValueError; the trainer only translates it into a ConfigError that names its own
keys, with moe_kernels' reason word for word.
"""

from __future__ import annotations

import re

import moe_kernels
from trainer.config.keys import ConfigError
from trainer.config.model_keys import ModelConfig

# MoEConfig field -> the trainer key that sets it, one to one. moe_kernels' messages
# name its fields; the ConfigError names the trainer's key where the two differ.
KEY_OF_FIELD = {
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "mlp_dim": "base_moe_mlp_dim",
    "n_groups": "n_routing_groups",
    "topk_groups": "topk_routing_group",
    "routed_scaling_factor": "routed_scaling_factor",
    "score_func": "routed_score_func",
    "topk_method": "routed_topk_method",
    "norm_topk_prob": "norm_topk_prob",
    "num_shared_experts": "shared_experts",
    # Same meaning on both sides: 0 = no token dropped.
    "capacity_factor": "capacity_factor",
    "grouped_matmul": "grouped_matmul",
}


def moe_config(model: ModelConfig) -> moe_kernels.MoEConfig:
    """The moe_kernels view of the trainer config; moe_kernels' ValueError for values
    it refuses (`check` names the trainer's keys)."""
    return moe_kernels.MoEConfig(
        **{field: getattr(model, key) for field, key in KEY_OF_FIELD.items()},
        # alpha / rank for the expert adapters (trainer.model.lora); unused without them.
        lora_scale=model.lora_alpha / model.lora_rank if model.lora_rank else 1.0,
        precision=None,
        # Per-token router z out of the layer only when the z-loss uses it.
        router_z_loss=bool(model.moe_z_loss_coeff),
    )


def check(model: ModelConfig) -> None:
    """ConfigError naming the trainer's keys when moe_kernels refuses their values.

    >>> from trainer.config import make_config
    >>> check(make_config({"n_routing_groups": "3"}).model)
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: n_routing_groups=3 (moe_kernels' n_groups): n_groups=3 does ...
    """
    try:
        moe_config(model)
    except ValueError as error:
        raise ConfigError(translate(str(error), model)) from error


def translate(reason: str, model: ModelConfig) -> str:
    """moe_kernels' `reason`, led by the trainer keys (and values) of the fields it
    names under another name; as it is where every field it names is a trainer key."""
    named = sorted(
        (match.start(), field)
        for field in KEY_OF_FIELD
        if (match := re.search(rf"\b{field}\b", reason))
    )
    renamed = [field for _, field in named if KEY_OF_FIELD[field] != field]
    if not named:  # names no field the trainer sets: say whose rule it is
        return f"moe_kernels.MoEConfig refuses the MoE keys: {reason}"
    if not renamed:
        return reason
    keys = ", ".join(
        f"{KEY_OF_FIELD[f]}={_shown(getattr(model, KEY_OF_FIELD[f]))}" for f in renamed
    )
    return f"{keys} (moe_kernels' {', '.join(renamed)}): {reason}"


def _shown(value: object) -> str:
    """A value as the trainer's messages write it: strings quoted, numbers as they are."""
    return repr(value) if isinstance(value, str) else str(value)
