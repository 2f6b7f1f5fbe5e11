"""MaxText's command-line pieces that tagtrain reads another way, so a copied command parses.

A command from MaxText's docs carries things tagtrain reads another way: the path of
MaxText's `base.yml` as first argument, keys that pick a kernel for the same math
(`attention`, whose MaxText values map onto tagtrain's own `attention` key;
`megablox`) or name a format (`tokenizer_type`). Each value is either
accepted, because tagtrain does what it asks (with a note at startup where tagtrain
does it by another route), or refused with one line saying why. Nothing is dropped
silently. MaxText keys with a meaning of their own here (`hardware`,
`skip_jax_distributed_system`, `sparse_matmul`, ...) are ordinary config keys.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable

from trainer.config.keys import ConfigError
from trainer.config.make import parse_overrides
from trainer.config.model_keys import ModelConfig

TRUE = ("true", "1", "yes")
FALSE = ("false", "0", "no")


# MaxText's attention values -> tagtrain's `attention` key (model/attention_kernel.py).
# Every kernel computes exact causal softmax attention; these pick the same one
# MaxText would on that hardware.
ATTENTION = {
    "autoselected": "auto",
    "dot_product": "dot_product",
    # MaxText's flash is splash on TPU and cuDNN's fused kernel on GPU: auto's choice.
    "flash": "auto",
    "cudnn_flash_te": "cudnn_flash",
    "cudnn_flash_jax": "cudnn_flash",
}
# tagtrain's own values: the `attention` key's (model_keys.ModelConfig), one list.
OWN_ATTENTION = typing.get_args(typing.get_type_hints(ModelConfig)["attention"])


def _attention(value: str) -> tuple[str | None, str | None]:
    if value in OWN_ATTENTION:
        return value, None
    if value not in ATTENTION:
        raise ConfigError(
            f"attention={value!r} is not available: tagtrain computes exact causal "
            f"attention with {', '.join(OWN_ATTENTION)} (MaxText's "
            f"{', '.join(ATTENTION)} map onto them)"
        )
    ours = ATTENTION[value]
    note = None
    if value.startswith("cudnn_flash_"):
        note = (
            f"attention={value}: cuDNN's fused attention through JAX's cuDNN call "
            "(attention=cudnn_flash)"
        )
    elif value == "flash":
        note = (
            "attention=flash: the fused kernel for the hardware (attention=auto: "
            "splash on TPU, cudnn_flash on GPU)"
        )
    return ours, note


def _megablox(value: str) -> tuple[str | None, str | None]:
    lowered = value.lower()
    # megablox=false is MaxText's jax.lax.ragged_dot path: tagtrain's grouped matmul.
    if lowered in FALSE:
        return None, None
    if lowered in TRUE:
        return None, (
            "megablox=true: tagtrain's dropless grouped expert matmul is "
            "jax.lax.ragged_dot (MaxText's megablox=false; the same math)"
        )
    raise ConfigError(f"megablox={value!r} is not a boolean (true/false)")


def _tokenizer_type(value: str) -> tuple[str | None, str | None]:
    # tokenizer_path names a Hugging Face tokenizer.json here (tokenizers library).
    if value == "huggingface":
        return None, None
    raise ConfigError(
        f"tokenizer_type={value!r} is not supported: tokenizer_path must name a "
        "Hugging Face tokenizer.json (tokenizer_type=huggingface)"
    )


# key -> check(value) -> (the value tagtrain's own key of that name takes, or None:
# no such key, the value is absorbed; a startup note, or None when tagtrain does
# exactly that).
KEY_RULES: dict[str, Callable[[str], tuple[str | None, str | None]]] = {
    "attention": _attention,
    "megablox": _megablox,
    "tokenizer_type": _tokenizer_type,
}


def strip_config_file(args: list[str]) -> tuple[list[str], list[str]]:
    """`args` without a leading MaxText `base.yml` path, and the note saying so.

    MaxText's commands start with the path of its base config; tagtrain's defaults
    and presets stand in for it. Another YAML file would carry settings this command
    line does not show, so it is refused rather than skipped.
    """
    if not args or "=" in args[0] or not args[0].endswith((".yml", ".yaml")):
        return list(args), []
    path = args[0]
    if os.path.basename(path) != "base.yml":
        raise ConfigError(
            f"{path!r}: tagtrain reads no YAML config; pass its settings as key=value"
        )
    return list(args[1:]), [f"{path}: MaxText's base config; tagtrain's defaults stand in for it"]


def absorb(overrides: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """`overrides` with the KEY_RULES keys translated to tagtrain's values (or taken
    out where tagtrain has no such key), and a note per accepted value that tagtrain
    honours by another route; ConfigError (naming the key) for the rest."""
    kept: dict[str, str] = {}
    notes: list[str] = []
    for key, value in overrides.items():
        rule = KEY_RULES.get(key)
        if rule is None:
            kept[key] = value
            continue
        ours, note = rule(str(value))
        if ours is not None:
            kept[key] = ours
        if note:
            notes.append(note)
    return kept, notes


def read_command_line(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """`train`'s positional arguments -> (config overrides, startup notes): a MaxText
    base.yml path and the KEY_RULES keys taken out, every other `key=value` kept."""
    args, notes = strip_config_file(args)
    overrides, key_notes = absorb(parse_overrides(args))
    return overrides, notes + key_notes
