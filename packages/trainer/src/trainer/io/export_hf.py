"""`export-hf run_dir=RUN output=DIR [step=N] [export_dtype=float32|bfloat16] [adapter=true]`:
a run's checkpoint as a Hugging Face directory (adapter=true: a LoRA run's adapters
alone, as a PEFT adapter directory, hf/peft.py).

Reads the run's config from the checkpoint, restores the parameters and routing
biases of step N (default: the newest), writes them with `trainer.hf.save` and
copies the run's tokenizer (tokenizer_path, as tokenizer.json) beside them, with
the tokenizer_config.json, special_tokens_map.json and chat_template.jinja that lie
beside it (the chat template stays in the file it came in). Each source config.json
key written otherwise is printed, `config.json: KEY OLD -> NEW (why)`. A run
started from `hf_model_path` exports over that directory's config.json (the keys
training did not change kept as they were), its generation_config.json and, unless
export_dtype says otherwise, its dtype (bfloat16 for fp8 files). A LoRA run's
checkpoint holds its adapters: its frozen base is loaded again as the run loaded it
(hf_model_path, load_parameters_path, or drawn from the seed) and the merged weights
W + lora_alpha / lora_rank x A @ B are written.
"""

from __future__ import annotations

import os
import shutil
import sys

from trainer import _host, hf
from trainer import model as model_lib
from trainer.config import ConfigError, hf_map, parse_overrides
from trainer.io import checkpoint_host
from trainer.io.initial_weights import (
    restore_parameters,
    restore_run_weights,
    saved_run_config,
    step_directory,
)

KEYS = ("run_dir", "output", "step", "export_dtype", "adapter")


def _arguments(argv: list[str]) -> dict[str, str]:
    args = parse_overrides(argv)
    for key in args:
        if key not in KEYS:
            raise ConfigError(f"export-hf: unknown argument {key!r} (takes {', '.join(KEYS)})")
    for key in ("run_dir", "output"):
        if not args.get(key):
            raise ConfigError(f"export-hf: {key}= is required")
    return args


def _adapter(step_path: str, output: str, config, source: str | None) -> list[str]:
    """A LoRA run's adapters as a PEFT adapter directory (hf.peft); the lines to print."""
    ctx = hf.default_ctx(config)
    model = model_lib.define(config.model, ctx)
    if not model.lora:
        raise ConfigError("export-hf: adapter=true needs a LoRA run (this run has lora_rank=0)")
    saved = restore_parameters(step_path, ctx, model, adapters=True)
    params, _ = model_lib.abstract_state(model, ctx)
    base = os.path.abspath(source) if source else None
    hf.peft.save_adapter(output, config, saved["params"], params, base)
    if base:
        return [f"adapter: PEFT LoRA over {base} (PeftModel.from_pretrained(base, output))"]
    return [
        "adapter: the run's base is not a Hugging Face directory (load_parameters_path or "
        "seed): export that base with export-hf and load the adapter over it"
    ]


def export(
    run_dir: str,
    output: str,
    step: int | None = None,
    dtype: str | None = None,
    adapter: bool = False,
) -> tuple[str, list[str]]:
    """Write step `step` (newest: None) of the run in `run_dir` to `output` in `dtype`
    (None: the source's, see the module doc); `adapter`: a LoRA run's adapters alone,
    in PEFT's format. Returns the checkpoint directory read and lines to print (the
    source config.json keys written otherwise, hf.export_config.changes)."""

    if dtype is not None and dtype not in hf.export_config.EXPORT_DTYPES:
        raise ConfigError(f"export_dtype={dtype!r} is not one of {hf.export_config.EXPORT_DTYPES}")
    checkpoints = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    if not os.path.isdir(checkpoints):
        raise ConfigError(f"export-hf: {checkpoints} not found (run_dir= is a run's directory)")
    path = os.path.join(checkpoints, str(step)) if step is not None else checkpoints
    if step is not None and not os.path.isdir(path):
        raise ConfigError(f"export-hf: no checkpoint of step {step} in {checkpoints}")
    directory, step = step_directory(path)
    config, paths = saved_run_config(directory, step)
    source = paths["hf_model_path"] or None
    hf_map.to_hf(config)  # refuses an unexportable config before any reading
    if source and hf.export_config.read_source(source) is None:
        print(f"export-hf: {source}/config.json is gone: config.json from the run's keys alone")
        source = None
    step_path = os.path.join(directory, str(step))
    if adapter:
        lines = _adapter(step_path, output, config, paths["hf_model_path"] or None)
    else:
        trees = _weights(step_path, config, paths)
        changed = hf.save(output, config, trees, dtype=dtype, source=source)
        lines = [f"config.json: {line}" for line in changed]
    if config.tokenizer_path and os.path.isfile(config.tokenizer_path):
        shutil.copyfile(config.tokenizer_path, os.path.join(output, "tokenizer.json"))
        hf.copy_tokenizer(os.path.dirname(config.tokenizer_path), output)
    return step_path, lines


def _weights(step_path: str, config, paths: dict[str, str]) -> dict[str, dict]:
    """{"params", "router"} to write: the saved arrays, read on the host (no JAX
    backend starts, so no libtpu lockfile is taken); for a LoRA run the base with the
    adapters merged, which computes (on JAX's CPU platform: main pins it)."""
    if not config.model.lora_rank:
        return checkpoint_host.read_arrays(step_path, "state", ("params", "router"))
    ctx = hf.default_ctx(config)
    return restore_run_weights(step_path, config, paths, ctx, model_lib.define(config.model, ctx))


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    argv = sys.argv[1:] if argv is None else argv
    # It computes nothing on a device: a run's weights are read on the host with no
    # backend at all; a LoRA run's merge computes on the CPU platform, pinned here. No
    # accelerator runtime starts, so no libtpu lockfile stops a TPU run or compile
    # beside it.
    _host.cpu_only()
    try:
        args = _arguments(argv)
        step = int(args["step"]) if args.get("step") else None
        adapter = args.get("adapter", "false")
        if adapter not in ("true", "false"):
            raise ConfigError(f"export-hf: adapter={adapter!r} is not true or false")
        source, lines = export(
            args["run_dir"], args["output"], step, args.get("export_dtype"), adapter == "true"
        )
    except (ConfigError, ValueError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    print(f"exported {source} -> {args['output']}")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
