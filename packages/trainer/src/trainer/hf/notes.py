"""Startup lines for what an import reads otherwise than config.json says, or does
not use: keys transformers ignores, Moonlight's two epsilons, Kimi-K2's model_type,
DeepSeek's balance-loss keys (hf.import_params prints them)."""

from __future__ import annotations

from trainer.config import Config
from trainer.config.hf_map import (
    IGNORED_BY_HF,
    LATENT_NORM_EPS,
    balance_weight,
    family_of,
    num_moe_layers,
    value_of,
)


def lines(hf: dict, config: Config | None = None) -> list[str]:
    """What the import reads differently from what config.json says, or does not use,
    one line each, for the startup log (`config`: the run's, to name explicit keys)."""
    family = family_of(hf)
    out = []
    if hf["model_type"] != family:
        out.append(f"model_type={hf['model_type']!r} read as {family} (the same layout)")
    for key, used in IGNORED_BY_HF[family].items():
        if hf.get(key) is not None and hf[key] != used:
            out.append(f"{key}={hf[key]!r} ignored: transformers' {family} uses {used!r}")
    greedy = family == "deepseek_v2" and value_of(hf, "topk_method", family) == "greedy"
    if greedy and (hf.get("n_group") or 1) > 1:
        out.append(f"n_group={hf['n_group']} ignored: topk_method=greedy has no groups")
    derived = {"qk_head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]}
    if family == "deepseek_v2":
        derived["head_dim"] = hf["qk_rope_head_dim"]
    for key, value in derived.items():
        if hf.get(key) not in (None, value):
            out.append(f"{key}={hf[key]} ignored: transformers sets it to {value}")
    eps = value_of(hf, "rms_norm_eps", family)
    if eps != LATENT_NORM_EPS:
        out.append(
            f"rms_norm_eps={eps} for the decoder norms; the MLA latent norms (q_a_layernorm, "
            f"kv_a_layernorm) keep transformers' fixed {LATENT_NORM_EPS} (latent_norm_epsilon)"
        )
    out += _balance_notes(hf, family, config)
    return out


def _balance_notes(hf: dict, family: str, config: Config | None) -> list[str]:
    alpha = hf.get("aux_loss_alpha") or 0.0
    if not alpha:
        return []
    weight = balance_weight(hf, family)
    if weight is None:
        return [
            f"aux_loss_alpha={alpha} with seq_aux=false (DeepSeek's batch-wise balance loss) "
            "is not used: load_balance_loss_weight is the sequence-wise loss; set it to use that"
        ]
    line = (
        f"aux_loss_alpha={alpha} (sequence-wise, seq_aux) -> load_balance_loss_weight={weight:g}: "
        f"DeepSeek adds the loss of each of the {num_moe_layers(hf, family)} MoE layers, "
        "the trainer weights their mean"
    )
    if config is not None and config.load_balance_loss_weight != weight:
        line += (
            f"; load_balance_loss_weight={config.load_balance_loss_weight:g} given explicitly wins"
        )
    return [line]
