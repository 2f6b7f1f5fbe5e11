"""Uneven pipeline stages: the MoE stack padded to equal chunks in memory, its real
layers alone in checkpoints.

With stages x repeats chunks that do not divide the L MoE layers, the in-memory
stack (`Decoder.moe_layers`, and the optimizer's moments of it) has stages x
repeats x c slots (`config.pipeline.layer_slots` says which slot holds which layer;
the padding slots are zeros the pipeline skips), so it shards evenly over 'stage'.
What leaves or enters a run keeps the L real layers: initial weights draw L rows
(model.init) and checkpoints hold L rows (`to_stored` on save, `to_slots` on
restore), so a checkpoint resumes on any stage count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.config import Config, ModelConfig
from trainer.config.pipeline import layer_slots, padded_layers, stage_count

# The stack the pipeline splits (model.PIPELINED; here too so io need not import model).
PIPELINED = "moe_layers"


@dataclasses.dataclass(frozen=True)
class Slots:
    """A padded MoE stack: `size` slots, the real layers in `slots` (layer order)."""

    slots: tuple[int, ...]
    size: int

    @property
    def layers(self) -> int:
        """The real layers (the checkpoint's rows)."""
        return len(self.slots)


def stack_slots(model: ModelConfig, stages: int, repeats: int) -> Slots | None:
    """The padded stack's layout, or None when it is not padded (one stage, or
    chunks that divide the layers)."""
    layers = model.num_moe_layers
    size = padded_layers(layers, stages, repeats) if layers else 0
    if stages == 1 or size == layers:
        return None
    return Slots(layer_slots(layers, stages, repeats), size)


def config_slots(config: Config) -> Slots | None:
    """`stack_slots` of a run's config (its stage count and repeats)."""
    return stack_slots(config.model, stage_count(config), config.num_pipeline_repeats)


def _in_stack(path: tuple, leaf: Any, size: int) -> bool:
    """Whether `leaf` (at tree `path`) is a stack's array: under moe_layers (the
    params, or an optimizer moment of them) with `size` rows."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    shape = getattr(leaf, "shape", ())
    return PIPELINED in keys and len(shape) >= 1 and shape[0] == size


def _rows_whole(sharding: Any, ndim: int) -> Any:
    """`sharding` with the layer dim unsharded (L rows need not split over 'stage')."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(None, *spec[1:]))


def _map_stacks(tree: Any, size: int, fn) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: fn(leaf) if _in_stack(path, leaf, size) else leaf, tree
    )


def to_stored(tree: Any, layout: Slots | None) -> Any:
    """`tree` (params, optimizer state: any tree holding the padded stack) with each
    padded stack's real rows only, in layer order, the layer dim unsharded."""
    if layout is None:
        return tree
    index = np.asarray(layout.slots, np.int32)

    def one(x):
        whole = _rows_whole(x.sharding, x.ndim)
        return jax.jit(lambda v: v[index], out_shardings=whole)(jax.device_put(x, whole))

    return _map_stacks(tree, layout.size, one)


def stored_abstract(tree: Any, layout: Slots | None) -> Any:
    """ShapeDtypeStructs of `to_stored(tree)` (what a checkpoint of `tree` holds)."""
    if layout is None:
        return tree

    def one(x):
        sharding = _rows_whole(getattr(x, "sharding", None), len(x.shape))
        return jax.ShapeDtypeStruct((layout.layers, *x.shape[1:]), x.dtype, sharding=sharding)

    return _map_stacks(tree, layout.size, one)


def to_slots(stored: Any, target: Any, layout: Slots | None) -> Any:
    """The inverse of `to_stored`: `stored`'s real rows put in their slots of zeros,
    in `target`'s shapes and shardings (a tree like `stored` with padded stacks)."""
    if layout is None:
        return stored
    index = np.asarray(layout.slots, np.int32)

    def one(path, x, want):
        if not _in_stack(path, want, layout.size):
            return x
        whole = _rows_whole(want.sharding, x.ndim)
        pad = jax.jit(
            lambda v: jnp.zeros(want.shape, v.dtype).at[index].set(v), out_shardings=whole
        )
        return jax.device_put(pad(jax.device_put(x, whole)), want.sharding)

    return jax.tree_util.tree_map_with_path(one, stored, target)


def pad_rows(value: np.ndarray, layout: Slots) -> np.ndarray:
    """A host array of the L real layers' rows in the padded stack's slots (zeros)."""
    out = np.zeros((layout.size, *value.shape[1:]), value.dtype)
    out[np.asarray(layout.slots)] = value
    return out
