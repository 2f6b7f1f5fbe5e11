"""The configuration: every key once, in its group, with its default and meaning.

- `Config` (config.py): every key a flat attribute, each group a view
  (`config.data` is a DataConfig); the groups' dataclasses are model_keys.py and
  run_keys.py, the shared words (mesh axes, ConfigError, `key`) keys.py.
- `make_config(overrides)` / `parse_overrides(words)` (make.py): a preset
  (presets.py) plus a Hugging Face directory's keys (hf_map.py) plus the overrides,
  type-checked. `validate(config, num_devices)` (validate.py): what depends on the
  machine. `mesh_shape` (mesh_shape.py): the mesh from the *_parallelism keys.
- `moe_map.py`: the MoE keys as moe_kernels' MoEConfig (the one mapping), whose
  refusals it names by the trainer's keys.
- `lora_targets.py`: LoRA's target names and rules; `maxtext_compat.py`: MaxText's
  command line (a YAML path first); `reference.py`: docs/config.md.

Nothing here imports the rest of the trainer: every other subpackage reads the
configuration, none is read by it.
"""

from trainer.config.config import FIELDS, GROUPS, Config
from trainer.config.keys import (
    DCN_AXES,
    DTYPES,
    HYBRID_AXES,
    ICI_AXES,
    MESH_AXES,
    OTHER_DCN_KEYS,
    ROPE_TYPES,
    STAGE_AXIS,
    ConfigError,
)
from trainer.config.make import REPLACED_KEYS, make_config, parse_overrides
from trainer.config.mesh_shape import dcn_parts, mesh_shape
from trainer.config.model_keys import ModelConfig
from trainer.config.presets import PRESETS
from trainer.config.run_keys import (
    AccumulationConfig,
    CheckpointingConfig,
    DataConfig,
    EvaluationConfig,
    OutputConfig,
    ParallelismConfig,
    TrainingConfig,
)

__all__ = [
    "DCN_AXES",
    "DTYPES",
    "FIELDS",
    "GROUPS",
    "ICI_AXES",
    "MESH_AXES",
    "HYBRID_AXES",
    "STAGE_AXIS",
    "OTHER_DCN_KEYS",
    "PRESETS",
    "REPLACED_KEYS",
    "ROPE_TYPES",
    "AccumulationConfig",
    "CheckpointingConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvaluationConfig",
    "ModelConfig",
    "OutputConfig",
    "ParallelismConfig",
    "TrainingConfig",
    "dcn_parts",
    "make_config",
    "mesh_shape",
    "parse_overrides",
]
