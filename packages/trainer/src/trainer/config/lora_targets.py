"""LoRA's target names (`lora_targets`) and the rules for lora_rank / lora_alpha /
lora_targets: what a model has to adapt, checked before anything is built
(docs/finetune.md#lora; the adapters themselves are trainer/model/lora.py).

A word is a trainer parameter name (wq_a ...), a group (attention ...), or a
transformers module name as PEFT's `target_modules` takes it (q_a_proj, kv_b_proj,
gate_proj ..., `all-linear`)."""

from __future__ import annotations

from trainer.config.keys import ConfigError
from trainer.config.model_keys import ModelConfig

# Keyword arguments, not a dict literal: the config reference would take the group
# name `attention` for the config key of that name.
GROUPS: dict[str, tuple[str, ...]] = dict(
    attention=("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo"),
    mlp=("mlp_wi_0", "mlp_wi_1", "mlp_wo"),
    experts=("expert_wi_0", "expert_wi_1", "expert_wo"),
    shared_experts=("shared_wi_0", "shared_wi_1", "shared_wo"),
)
TARGETS = tuple(name for names in GROUPS.values() for name in names)
# transformers' module names, as PEFT's `target_modules` takes them: a name selects the
# trainer projections held in the checkpoint under that name (gate_proj: the dense
# MLP's, the shared experts' and every routed expert's, model.layers.{i}.mlp.experts.
# {e}.gate_proj.weight). `all-linear` (PEFT: every linear layer but the output head)
# is every projection the trainer adapts; the router never is.
HF_NAMES: dict[str, tuple[str, ...]] = {
    "q_proj": ("wq",),
    "q_a_proj": ("wq_a",),
    "q_b_proj": ("wq_b",),
    "kv_a_proj_with_mqa": ("wkv_a",),
    "kv_b_proj": ("wkv_b",),
    "o_proj": ("wo",),
    "gate_proj": ("mlp_wi_0", "shared_wi_0", "expert_wi_0"),
    "up_proj": ("mlp_wi_1", "shared_wi_1", "expert_wi_1"),
    "down_proj": ("mlp_wo", "shared_wo", "expert_wo"),
    "all-linear": TARGETS,
}
# Selecting what a model has of them (a group, or a transformers name).
SELECTORS = {**GROUPS, **HF_NAMES}


def _absent(model: ModelConfig, name: str) -> str | None:
    """Why this model has no projection `name` (None: it has one)."""
    dense_blocks = model.first_num_dense_layers or (
        model.mtp_num_layers and not model.num_moe_layers
    )
    if name == "wq" and model.q_lora_rank:
        return f"q_lora_rank={model.q_lora_rank}: the queries go through wq_a and wq_b"
    if name in ("wq_a", "wq_b") and not model.q_lora_rank:
        return "q_lora_rank=0: the queries have one plain projection, wq"
    if name in GROUPS["mlp"] and not dense_blocks:
        return "the model has no dense MLP block (first_num_dense_layers=0)"
    if name in GROUPS["experts"] + GROUPS["shared_experts"] and not model.num_moe_layers:
        return "the model has no MoE layer"
    if name in GROUPS["shared_experts"] and not model.shared_experts:
        return "shared_experts=0"
    return None


def _words(model: ModelConfig) -> list[str]:
    """lora_targets' words; ConfigError for an unknown one or none at all."""
    words = [w.strip() for w in model.lora_targets.split(",") if w.strip()]
    if not words:
        raise ConfigError(f"lora_targets={model.lora_targets!r} names no target")
    for word in words:
        if word not in SELECTORS and word not in TARGETS:
            known = ", ".join((*GROUPS, *TARGETS, *HF_NAMES))
            raise ConfigError(f"lora_targets: unknown target {word!r} (known: {known})")
    return words


def resolve_targets(model: ModelConfig) -> frozenset[str]:
    """The target names `lora_targets` selects in this model; ConfigError naming an
    unknown word, a projection the model lacks, or a group of which it has none."""
    chosen: set[str] = set()
    for word in _words(model):
        if word in SELECTORS:
            present = [n for n in SELECTORS[word] if _absent(model, n) is None]
            if not present:
                reason = "; ".join(sorted({str(_absent(model, n)) for n in SELECTORS[word]}))
                raise ConfigError(f"lora_targets: {word!r} selects nothing here ({reason})")
            chosen.update(present)
        else:
            reason = _absent(model, word)
            if reason:
                raise ConfigError(f"lora_targets: {word!r} is not in this model ({reason})")
            chosen.add(word)
    return frozenset(chosen)


def check(model: ModelConfig) -> None:
    """ConfigError for a bad lora_rank / lora_alpha / lora_targets (before compiling)."""
    if model.lora_rank < 0:
        raise ConfigError(f"lora_rank={model.lora_rank} must be >= 0 (0: LoRA off)")
    if not model.lora_rank:
        _words(model)  # a misspelt name is refused even while LoRA is off
        return
    if not model.lora_alpha > 0:
        raise ConfigError(f"lora_alpha={model.lora_alpha} must be > 0")
    resolve_targets(model)
