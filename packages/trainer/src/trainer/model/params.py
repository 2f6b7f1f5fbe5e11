"""Parameter creation with logical axis names attached as NNX metadata."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Metadata key holding a parameter's logical axes. Flax's own `sharding_names`
# would make NNX shard eagerly on creation; we shard once, after init, with
# pspec_tags so one rule set serves explicit and auto mode.
LOGICAL = "logical_axes"
# How `host_values` draws the parameter: ("normal", stddev) | ("ones",) | ("zeros",).
INIT = "init"
# Whether the model's one use of the parameter starts by casting it to the
# compute dtype (matmul weights). Such a parameter may be cast before it is
# gathered (ZeRO-1): same values, half the memory. Not so for norm scales (used
# in f32) or the embedding table (rows are cast after the lookup, so its
# gradient's scatter-add runs in f32).
CAST_AT_USE = "cast_at_use"
# The dtype the use computes in where the model casts the parameter up again
# after that cast (the MoE router's gate, in f32): autodiff's per-microbatch
# reduction of its cotangent runs in that dtype (XLA moves the cast back after
# the reduction; docs/cost_model.md). Unset: the cast's dtype.
USE_DTYPE = "use_dtype"
# Whether the use reads the parameter inside a shard_map from a copy replicated over
# the batch axes (the embedding table: pspec_tags.embed_lookup), so that autodiff's
# per-microbatch reduction is that shard_map's psum in its body: over every batch
# axis at once, at the copy's size. Where the copy is gathered (FSDP) that includes
# the gathered axes, and the sum is then sliced back to the shard.
SUMMED_IN_USE = "summed_in_use"


def param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    logical: Sequence[str | None],
    *,
    fan_in: int | None = None,
    init: str = "normal",
    dtype: str = "float32",
    cast_at_use: bool = True,
    summed_in_use: bool = False,
    kind: type[nnx.Variable] = nnx.Param,
) -> nnx.Variable:
    """A parameter of `shape` named by `logical`; 'normal' is scaled by 1/sqrt(fan_in).

    `kind`: the variable type (nnx.Param; lora.LoraParam for an adapter factor, which
    `trainer.model.define` splits from the parameters it freezes)."""
    if len(shape) != len(logical):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical)} differ in rank")
    if init == "ones":
        value, recipe = jnp.ones(shape, dtype), ("ones",)
    elif init == "zeros":
        value, recipe = jnp.zeros(shape, dtype), ("zeros",)
    else:
        scale = (fan_in or shape[0]) ** -0.5
        value, recipe = (
            (jax.random.normal(rngs.params(), shape) * scale).astype(dtype),
            (
                "normal",
                scale,
            ),
        )
    metadata = {LOGICAL: tuple(logical), INIT: recipe, CAST_AT_USE: cast_at_use}
    if summed_in_use:
        metadata[SUMMED_IN_USE] = True
    return kind(value, **metadata)


def host_value(
    variable: nnx.Variable, path: tuple, seed: int, rows: int | None = None
) -> np.ndarray:
    """The variable's initial value drawn on the host, deterministic in (seed, path).

    Host drawing keeps start-up cheap (compiling a jitted init of every random
    parameter took longer than compiling the train step) and makes the values
    independent of the mesh, so sharded and single-device runs start equal.
    `rows`: draw that many rows of a stacked variable (its real layers, when the
    stack is padded for uneven pipeline stages: model/pipeline_slots.py).
    """
    abstract = variable.get_value()
    shape, dtype = abstract.shape, np.dtype(abstract.dtype)
    if rows is not None:
        shape = (rows, *shape[1:])
    recipe = variable.get_metadata().get(INIT, ("zeros",))
    if recipe[0] == "ones":
        return np.ones(shape, dtype)
    if recipe[0] == "zeros":
        return np.zeros(shape, dtype)
    name = "/".join(str(k) for k in path).encode()
    rng = np.random.default_rng([seed, zlib.crc32(name)])
    return (rng.standard_normal(shape, dtype=np.float32) * recipe[1]).astype(dtype)


def cast_at_use_of(variable: nnx.Variable, stacked: bool = False) -> bool:
    """The parameter's CAST_AT_USE flag (False when unset)."""
    del stacked  # same signature as logical_axes_of
    return bool(variable.get_metadata().get(CAST_AT_USE, False))


def use_dtype_of(variable: nnx.Variable, stacked: bool = False) -> str | None:
    """The parameter's USE_DTYPE (None when unset)."""
    del stacked  # same signature as logical_axes_of
    return variable.get_metadata().get(USE_DTYPE)


def summed_in_use_of(variable: nnx.Variable, stacked: bool = False) -> bool:
    """The parameter's SUMMED_IN_USE flag (False when unset)."""
    del stacked  # same signature as logical_axes_of
    return bool(variable.get_metadata().get(SUMMED_IN_USE, False))


def logical_axes_of(variable: nnx.Variable, stacked: bool = False) -> tuple[str | None, ...]:
    """The logical axes of a variable; `stacked` prepends the scanned 'layers' axis."""
    axes = tuple(variable.get_metadata().get(LOGICAL, ()))
    return (("layers",) + axes) if stacked else axes
