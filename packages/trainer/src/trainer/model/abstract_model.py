"""The model's parameters as shapes on an abstract mesh: counting, planning and
predicting without a device, a compile or an allocation.

`plan-reduction` lays them out on a TPU topology's mesh; tests and benchmarks count
parameters on the 8-device mesh of the CPU tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType

from trainer import model as model_lib
from trainer.config import MESH_AXES, Config
from trainer.config.validate import validate
from trainer.sharding import ShardCtx, logical_rules


@dataclasses.dataclass(frozen=True)
class AbstractModel:
    """The model on an abstract mesh: nothing allocated."""

    ctx: Any  # ShardCtx on the AbstractMesh
    model: Any  # model.ModelDef
    params: Any  # ShapeDtypeStructs in the compute layout
    router: Any
    adapters: Any = None  # the LoRA factors (lora_rank > 0): what is trained then


def parameters(config: Config, num_devices: int = 8, num_slices: int = 1) -> AbstractModel:
    """The model of `config` on an abstract mesh of `num_devices` laid out by its
    parallelism keys, parameters and router state as ShapeDtypeStructs.

    Raises ConfigError (trainer.config.validate) when the parallelism does not fit the
    device count; no device is touched. Takes the Config: validate and the model
    definition read all of it."""
    sizes = validate(config, num_devices, num_slices)
    kind = AxisType.Explicit if config.shard_mode == "explicit" else AxisType.Auto
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    mesh = AbstractMesh(shape, MESH_AXES, axis_types=(kind,) * len(MESH_AXES))
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)
    with jax.sharding.use_abstract_mesh(mesh):
        model = model_lib.define(config.model, ctx)
        params, router = model_lib.abstract_state(model, ctx)
        adapters = model_lib.abstract_adapters(model, ctx)
    return AbstractModel(ctx, model, params, router, adapters)
