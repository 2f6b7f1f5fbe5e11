"""What `generate` runs: the model's config, its tokenizer and eos, then its weights.

From `hf_model_path=DIR`: DIR's config.json (trainer.hf), its tokenizer.json, the eos
of its generation_config.json (else config.json). From `run_dir=DIR`: the config the
run saved with its newest checkpoint (or `step=`), that checkpoint's parameters and
routing biases, the run's tokenizer (its `tokenizer_path`; byte tokens for a text run
without one) and the eos declared beside that tokenizer.json, else the tokenizer's own.
Everything but the weights is read first, so every check runs before any loading.
"""

from __future__ import annotations

import dataclasses
import json
import os

from trainer.config import Config, ConfigError
from trainer.generate import codec
from trainer.generate.args import Arguments
from trainer.io.initial_weights import saved_run_config, step_directory


@dataclasses.dataclass(frozen=True)
class Source:
    """A model to generate from, weights not read yet."""

    config: Config
    where: str  # for the startup line
    codec: codec.Codec | None  # None: no tokenizer, prompt_ids only
    eos_ids: tuple[int, ...]
    hf_model_path: str = ""
    checkpoint: str = ""  # run_dir/checkpoints/N
    # generation_config.json's sampling keys (do_sample, temperature, top_k, top_p).
    generation: tuple[tuple[str, object], ...] = ()
    # The run's initial-weight paths (saved_run_config): a LoRA run's base.
    base_paths: tuple[tuple[str, str], ...] = ()

    def load(self) -> dict[str, dict]:
        """{"params", "router"} on one device (trainer.hf.default_ctx)."""
        # deferred: the arguments are checked before JAX and the model code load
        from trainer import hf
        from trainer import model as model_lib
        from trainer.io.initial_weights import restore_run_weights

        ctx = hf.default_ctx(self.config)
        if self.hf_model_path:
            return hf.import_params(self.hf_model_path, self.config, ctx, progress=False)
        model = model_lib.define(self.config.model, ctx)
        # A LoRA run's checkpoint holds adapters: its base is loaded as the run loaded it.
        paths = dict(self.base_paths)
        return restore_run_weights(self.checkpoint, self.config, paths, ctx, model)


def _checkpoint(run_dir: str, step: int | None) -> tuple[str, int]:
    """(the run's checkpoints directory, the step to read)."""
    checkpoints = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    if not os.path.isdir(checkpoints):
        raise ConfigError(f"run_dir={run_dir!r} has no checkpoints/ (a run's directory)")
    if step is not None and not os.path.isdir(os.path.join(checkpoints, str(step))):
        raise ConfigError(f"step={step}: no checkpoint of that step in {checkpoints}")
    if step is not None:
        return checkpoints, step
    if not any(name.isdigit() for name in os.listdir(checkpoints)):
        raise ConfigError(f"run_dir={run_dir!r}: {checkpoints} holds no checkpoint step")
    return step_directory(checkpoints)


def _eos(args: Arguments, declared: tuple[int, ...] | None, tokenizer) -> tuple[int, ...]:
    """-1: none; an explicit id; else what the checkpoint declares, else the tokenizer's."""
    if args.eos_token_id is not None:
        return () if args.eos_token_id == -1 else (args.eos_token_id,)
    if declared is not None:
        return declared
    return () if tokenizer is None or tokenizer.eos_id is None else (tokenizer.eos_id,)


def _generation(directory: str) -> tuple[tuple[str, object], ...]:
    """The sampling keys of `directory`'s generation_config.json (() without one)."""
    path = os.path.join(directory, "generation_config.json") if directory else ""
    if not path or not os.path.isfile(path):
        return ()
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not JSON ({error})") from None
    keys = ("do_sample", "temperature", "top_k", "top_p")
    return tuple((k, values[k]) for k in keys if isinstance(values, dict) and k in values)


def _from_hf(args: Arguments, overrides: dict) -> Source:
    # deferred: the arguments are checked before JAX and the model code load
    from trainer import hf
    from trainer.hf import export_config

    path = args.hf_model_path
    # The checkpoint's dtype unless told otherwise (transformers' from_pretrained
    # dtype="auto"): float32 files compute in float32, bfloat16 and fp8 in bfloat16.
    source_config = export_config.read_source(path)
    if source_config is not None:
        dtype = export_config.source_dtype(source_config, path)
        overrides = {"dtype": dtype, "weight_dtype": dtype, **overrides}
    config = hf.config_from_hf(path, **overrides)
    tokenizer_file = args.tokenizer_path or os.path.join(path, "tokenizer.json")
    tokenizer = None
    if args.tokenizer_path or os.path.isfile(tokenizer_file):
        key = "tokenizer_path" if args.tokenizer_path else "hf_model_path's tokenizer.json"
        tokenizer = codec.from_file(tokenizer_file, key=key)
    eos = _eos(args, codec.checkpoint_eos(path), tokenizer)
    where = f"Hugging Face directory {path}"
    return Source(config, where, tokenizer, eos, generation=_generation(path), hf_model_path=path)


def _run_tokenizer(args: Arguments, config: Config) -> tuple[codec.Codec | None, str]:
    """The run's tokenizer and the directory its tokenizer.json lies in ('' for none)."""
    if args.tokenizer_path:
        return codec.from_file(args.tokenizer_path), os.path.dirname(args.tokenizer_path)
    if config.tokenizer_path and os.path.isfile(config.tokenizer_path):
        path = config.tokenizer_path
        return codec.from_file(path, key="the run's tokenizer_path"), os.path.dirname(path)
    if config.dataset_type != "synthetic" and not config.tokenizer_path:
        return codec.bytes_codec(), ""  # trained on text as byte tokens
    return None, ""


def _from_run(args: Arguments, overrides: dict) -> Source:
    checkpoints, step = _checkpoint(args.run_dir, args.step)
    config, paths = saved_run_config(checkpoints, step, overrides)
    tokenizer, tokenizer_dir = _run_tokenizer(args, config)
    declared = codec.checkpoint_eos(tokenizer_dir) if tokenizer_dir else None
    eos = _eos(args, declared, tokenizer)
    path = os.path.join(checkpoints, str(step))
    base = tuple(paths.items()) if config.lora_rank else ()
    generation = _generation(tokenizer_dir)
    return Source(
        config,
        f"checkpoint {path}",
        tokenizer,
        eos,
        generation=generation,
        checkpoint=path,
        base_paths=base,
    )


def choose_source(args: Arguments) -> Source:
    """The Source `args` name, every check done, no weight read; ConfigError naming
    the key of anything that is missing or wrong."""
    overrides = dict(args.model_overrides)
    source = _from_hf(args, overrides) if args.hf_model_path else _from_run(args, overrides)
    vocab = source.config.vocab_size
    if source.codec is not None and source.codec.vocab_size > vocab:
        raise ConfigError(
            f"the {source.codec.name} tokenizer has {source.codec.vocab_size} ids, more than "
            f"the model's vocab_size={vocab}"
        )
    for eos in source.eos_ids:
        if eos >= vocab:
            raise ConfigError(f"eos_token_id={eos} is not below the model's vocab_size={vocab}")
    return source
