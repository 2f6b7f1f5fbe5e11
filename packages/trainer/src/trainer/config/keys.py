"""The words every config module shares: the mesh axes, ConfigError, and
`key`, the one way a key is declared (default and one-line meaning).

Key names follow MaxText where the concept is the same, so a MaxText user can
carry their overrides over (`per_device_batch_size`, `ici_fsdp_parallelism`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The in-slice (ICI) axes, sized by ici_<axis>_parallelism.
ICI_AXES = ("data", "fsdp", "tensor", "tensor_transpose", "context", "expert")
# The cross-slice (DCN) axes, sized by dcn_<axis>_parallelism: each is its own mesh
# axis ("dcn_data" beside "data"), outermost, so one slice is a contiguous block of
# the mesh and a gradient can be unreduced over the slices while sharded inside one.
DCN_AXES = ("dcn_data", "dcn_fsdp")
# The pipeline's stages (ici_pipeline_parallelism x dcn_pipeline_parallelism, the
# cross-slice part major): outermost, before the dcn_ axes, so consecutive stages of
# one slice are neighbours and a stage boundary crosses slices only where the dcn
# part says (model/pipeline.py).
STAGE_AXIS = "stage"
MESH_AXES = (STAGE_AXIS,) + DCN_AXES + ICI_AXES
# The mesh axes with a cross-slice part folded in (major), keyed by the dcn_ key
# that sizes it: 'stage' (dcn_pipeline_parallelism) and 'expert'
# (dcn_expert_parallelism: DeepSeek-V3's expert parallelism over several hosts). One
# axis each, so the pipeline and the MoE all-to-all read one axis whatever crosses
# slices (sharding/slices.py lays the cross-slice part out).
HYBRID_AXES = {"dcn_pipeline": STAGE_AXIS, "dcn_expert": "expert"}
# MaxText's other cross-slice keys (configs/base.yml), accepted so a MaxText command
# line parses, and held to 1: only the batch (dcn_data, dcn_fsdp), the pipeline's
# stages (dcn_pipeline_parallelism) and the experts (dcn_expert_parallelism) are split
# across slices here; tensor or context parallelism across slices would put
# per-layer collectives on the slow DCN links.
OTHER_DCN_KEYS = tuple(
    f"dcn_{axis}_parallelism"
    for axis in (
        "fsdp_transpose",
        "sequence",
        "context",
        "context_autoregressive",
        "tensor",
        "tensor_transpose",
        "tensor_sequence",
        "autoregressive",
        "diloco",
    )
)
DTYPES = ("float32", "bfloat16")
ROPE_TYPES = ("default", "yarn")


class ConfigError(ValueError):
    """A bad configuration: the message names the offending key and value."""


# Its public name, as tracebacks and doctests print it.
ConfigError.__module__ = "trainer.config"


def key(default: Any, meaning: str) -> Any:
    """A config key's field: its default and its one-line meaning (docs/config.md)."""
    return dataclasses.field(default=default, metadata={"meaning": meaning})


# The keys come in groups, one dataclass each; Config inherits them all, so every key
# stays a flat attribute (and a flat MaxText name on the command line) while a module
# can take just the group it reads (`config.data` is a DataConfig). Each key is
# declared once, in its group, with its default and meaning.
