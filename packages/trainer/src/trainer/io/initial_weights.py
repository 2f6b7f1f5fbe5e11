"""Where a fresh run's initial weights come from, when not drawn at random.

`hf_model_path`: a Hugging Face directory, streamed onto the mesh (trainer.hf).
`load_parameters_path`: another run's checkpoint, parameters and routing biases
only (its optimizer state and step are not read). Both apply to a run's first
start only: a restart resumes from the run's own checkpoints.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

from trainer import hf
from trainer import model as model_lib
from trainer.config import (
    FIELDS,
    CheckpointingConfig,
    Config,
    ConfigError,
    ModelConfig,
    make_config,
)
from trainer.io import checkpoint_host
from trainer.model import pipeline_slots

# The keys naming where a run's first weights came from: not read again for a whole
# model, but a LoRA run's base (export-hf).
INITIAL_WEIGHTS = ("hf_model_path", "load_parameters_path")


@dataclasses.dataclass(frozen=True)
class Source:
    """One origin of initial weights; `load` returns (params, router) on the mesh."""

    kind: str  # "hf" | "checkpoint"
    path: str

    def describe(self) -> str:
        what = "Hugging Face directory" if self.kind == "hf" else "parameters of checkpoint"
        return f"{what} {self.path}"

    def load(self, config: Config, ctx, model) -> tuple[dict, dict]:
        """(params, router) on `ctx`'s mesh. Takes the Config: a Hugging Face import
        maps the whole of it (trainer.hf)."""
        if self.kind == "hf":
            trees = hf.import_params(self.path, config, ctx, model=model)
        else:
            trees = restore_parameters(self.path, ctx, model)
        return trees["params"], trees["router"]


def source(model: ModelConfig, checkpointing: CheckpointingConfig) -> Source | None:
    """The configured origin (ConfigError for both at once or a missing path)."""
    if model.hf_model_path and checkpointing.load_parameters_path:
        raise ConfigError("hf_model_path and load_parameters_path both set: choose one")
    for key, kind, path in (
        ("hf_model_path", "hf", model.hf_model_path),
        ("load_parameters_path", "checkpoint", checkpointing.load_parameters_path),
    ):
        if path:
            if not os.path.isdir(path):
                raise ConfigError(f"{key}={path!r} is not a directory")
            return Source(kind, path)
    return None


def step_directory(path: str) -> tuple[str, int]:
    """(checkpoints directory, step) for a step directory or a checkpoints directory
    (its newest numbered step)."""
    name = os.path.basename(os.path.normpath(path))
    if name.isdigit():
        return os.path.dirname(os.path.normpath(path)), int(name)
    steps = sorted(int(n) for n in os.listdir(path) if n.isdigit())
    if not steps:
        raise ConfigError(f"load_parameters_path={path!r} holds no checkpoint step")
    return path, steps[-1]


def restore_parameters(path: str, ctx, model, adapters: bool = False) -> dict[str, dict]:
    """params and router of another run's checkpoint, in this run's shardings.

    `adapters`: read a LoRA run's `params` (its adapters, shaped as `model`'s). Without
    it the checkpoint must hold a whole model: a LoRA run's does not (ConfigError).
    """
    import orbax.checkpoint as ocp

    directory, step = step_directory(path)
    params, router = model_lib.abstract_state(model, ctx)
    if adapters:
        params = model_lib.abstract_adapters(model, ctx)
    manager = ocp.CheckpointManager(
        os.path.abspath(directory), options=ocp.CheckpointManagerOptions(read_only=True)
    )
    if not adapters:
        _refuse_adapters_only(manager, step, path)
    padded = {"params": params, "router": router}
    # Uneven pipeline stages: a checkpoint holds the L real MoE layers (model/
    # pipeline_slots.py), put in their slots of this run's padded stack once read.
    target = pipeline_slots.stored_abstract(padded, model.moe_layout)
    # Only these two subtrees of the saved state: `partial_restore` where this orbax
    # has it, else the older spelling of the same (an empty `transforms`).
    partial = (
        {"partial_restore": True}
        if "partial_restore" in inspect.signature(ocp.args.PyTreeRestore).parameters
        else {"transforms": {}}
    )
    restore = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), **partial
    )
    restored = manager.restore(step, args=ocp.args.Composite(state=restore)).state
    return pipeline_slots.to_slots(restored, padded, model.moe_layout)


def lora_base(config: Config, paths: dict[str, str], ctx, model) -> tuple[dict, dict]:
    """(params, router) of a LoRA run's frozen base, loaded again as the run loaded
    it: `paths` (saved_run_config's hf_model_path / load_parameters_path), else drawn
    from the run's seed. ConfigError naming the key whose directory is gone."""
    with_paths = dataclasses.replace(config, **paths)
    try:
        origin = source(with_paths.model, with_paths.checkpointing)
    except ConfigError as error:
        raise ConfigError(f"the LoRA run's frozen base: {error}") from None
    if origin is None:
        return model_lib.init(ctx, model, config.seed)
    return origin.load(with_paths, ctx, model)


def restore_run_weights(
    step_path: str, config: Config, paths: dict[str, str], ctx, model
) -> dict[str, dict]:
    """{"params", "router"} a run's checkpoint `step_path` computes with: its
    parameters, or for a LoRA run the base with the adapters merged in (W + alpha /
    r A B; the base loaded by `lora_base`). What export-hf writes and generate runs."""
    if not model.lora:
        return restore_parameters(step_path, ctx, model)
    saved = restore_parameters(step_path, ctx, model, adapters=True)
    base, _ = lora_base(config, paths, ctx, model)
    return {"params": model_lib.merged(model, base, saved["params"]), "router": saved["router"]}


def saved_meta(manager, step: int) -> dict:
    """The JSON metadata saved with checkpoint `step` (the run's config keys among it)."""
    import orbax.checkpoint as ocp

    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def saved_run_config(
    checkpoints: str, step: int, overrides: dict | None = None
) -> tuple[Config, dict[str, str]]:
    """(Config, initial-weight paths) of the run whose checkpoint `step` lies under
    `checkpoints`, `overrides` winning. Rebuilt from the saved keys alone: the run's
    initial-weight paths are not read again (they may be gone), keys of another
    trainer version are left out."""
    # The JSON file itself, not orbax's restore: no JAX backend starts (export-hf).
    keys = checkpoint_host.read_json_item(os.path.join(checkpoints, str(step)), "meta")["config"]
    saved = {k: v for k, v in keys.items() if k in FIELDS and k not in INITIAL_WEIGHTS}
    paths = {k: keys.get(k, "") for k in INITIAL_WEIGHTS}
    return make_config({**saved, **(overrides or {})}), paths


def _refuse_adapters_only(manager, step: int, path: str) -> None:
    """ConfigError when step `step` is a LoRA run's: its params are adapters only."""
    rank = saved_meta(manager, step).get("config", {}).get("lora_rank", 0)
    if rank:
        raise ConfigError(
            f"load_parameters_path={path!r} is a LoRA run's checkpoint (lora_rank={rank}): "
            "it holds the adapters only; export it with export-hf (merged weights) and "
            "start from that directory with hf_model_path"
        )
