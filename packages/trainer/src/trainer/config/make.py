"""From `key=value` words to a type-checked Config: parse, check names, apply the
preset, the Hugging Face directory's keys, then the overrides."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

from trainer.config.config import FIELDS, Config
from trainer.config.hf_map import trainer_keys_of_directory
from trainer.config.keys import ConfigError
from trainer.config.presets import PRESETS


def _field_type(name: str) -> Any:
    return typing.get_type_hints(Config)[name]


def parse_value(key: str, raw: Any) -> Any:
    """Convert `raw` (a string from the command line, or a value) to the key's type."""
    hint = _field_type(key)
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if any(choice is True for choice in choices) and raw != "auto":
            # A boolean key with an "auto" value (scan_layers): true/false as any boolean.
            try:
                return _parse_bool(key, raw)
            except ConfigError:
                raise ConfigError(f"{key}={raw!r} is not true, false or auto") from None
        if raw not in choices:
            raise ConfigError(f"{key}={raw!r} is not one of {choices}")
        return raw
    if isinstance(hint, types.UnionType):
        hint = str
    if hint is bool:
        return _parse_bool(key, raw)
    if hint is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r} is not an integer")
        try:
            value = float(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not an integer") from None
        if not isinstance(value, int | float) or value != int(value):
            raise ConfigError(f"{key}={raw!r} is not an integer")
        return int(value)
    if hint is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r} is not a number") from None
    return str(raw)


def _parse_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    lowered = str(raw).lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigError(f"{key}={raw!r} is not a boolean (true/false)")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`['key=value', ...]` -> dict, rejecting anything not of that form."""
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {arg!r} is not of the form key=value")
        out[key.strip()] = value.strip()
    return out


def _check_known(keys: list[str]) -> None:
    for key in keys:
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")


# Removed boolean keys: their combination is now one value of
# gradient_accumulation_schedule, defer_gradient_reduction one of gradient_reduction_policy.
SCHEDULE_FLAGS = (
    "fused_gradient_accumulation",
    "overlap_gradient_reduction",
    "ring_reduce_scatter",
)
REPLACED_KEYS = (*SCHEDULE_FLAGS, "defer_gradient_reduction")


def _replacement(overrides: dict[str, Any]) -> str:
    """The `key=value` words that say what the removed keys in `overrides` said."""
    flag = lambda key, default: _parse_bool(key, overrides.get(key, default))  # noqa: E731
    words = []
    if set(SCHEDULE_FLAGS) & set(overrides):
        if flag("ring_reduce_scatter", False):
            schedule = "overlapped_ring"
        elif flag("overlap_gradient_reduction", False):
            schedule = "overlapped"
        else:
            schedule = "fused" if flag("fused_gradient_accumulation", True) else "plain"
        words.append(f"gradient_accumulation_schedule={schedule}")
    if "defer_gradient_reduction" in overrides:
        policy = "deferred" if flag("defer_gradient_reduction", True) else "per_microbatch"
        words.append(f"gradient_reduction_policy={policy}")
    return " ".join(words)


def _check_replaced(overrides: dict[str, Any]) -> None:
    """ConfigError naming the removed keys given and what to write instead.

    >>> make_config({"overlap_gradient_reduction": "true", "ring_reduce_scatter": "true"})
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: ... write gradient_accumulation_schedule=overlapped_ring instead
    """
    old = [k for k in overrides if k in REPLACED_KEYS]
    if old:
        raise ConfigError(f"{', '.join(old)} removed: write {_replacement(overrides)} instead")


def make_config(overrides: dict[str, Any] | None = None) -> Config:
    """Preset for `model_name` (default tagtrain-tiny) + `overrides`, type-checked.

    Only structural checks happen here; `validate(config, num_devices)` checks
    what depends on the machine (mesh, batch sizes).

    >>> from trainer.config import make_config, parse_overrides
    >>> overrides = parse_overrides(["ici_fsdp_parallelism=4", "gradient_accumulation_steps=4"])
    >>> config = make_config(overrides)
    >>> config.model_name, config.ici_fsdp_parallelism, config.gradient_accumulation_steps
    ('tagtrain-tiny', 4, 4)
    >>> make_config({"gradient_accumulaton_steps": "4"})
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: unknown config key ...; did you mean 'gradient_accumulation_steps'?
    """
    overrides = dict(overrides or {})
    _check_replaced(overrides)
    _check_known(list(overrides))
    model_name = overrides.get("model_name", Config.model_name)
    if model_name not in PRESETS:
        raise ConfigError(f"model_name={model_name!r} is not one of {sorted(PRESETS)}")
    values = dict(PRESETS[model_name])
    if overrides.get("hf_model_path"):
        text = overrides.get("dataset_type", values.get("dataset_type")) not in (None, "synthetic")
        values.update(trainer_keys_of_directory(str(overrides["hf_model_path"]), text))
    values.update(overrides)
    return Config(**{key: parse_value(key, raw) for key, raw in values.items()})
