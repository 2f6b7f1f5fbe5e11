"""A checkpoint's arrays against the run's: the shapes and dtypes must be the model's,
except the optimizer state's float dtypes, which are cast.

AdamW's moments follow mu_dtype / nu_dtype (step/adam_moments.py): a checkpoint saved
with float32 moments restores into a bf16-moment run (or back), read in the dtype it was
saved in (so its checksums are checked on the saved bytes), then cast, the one rounding
a run of that dtype makes at every step. Anything else that differs (a parameter's
dtype, any shape) is another model's array: damage, as before.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from trainer.io import checksums
from trainer.io.checkpoint_files import Damaged

CASTABLE_PREFIX = "opt_state."  # array names (checksums.array_names) of the optimizer state


def _floating(name: str) -> bool:
    # jnp's test: numpy's does not count ml_dtypes' bfloat16 as floating.
    return jnp.issubdtype(jnp.dtype(name), jnp.floating)


def as_saved(state: Any, expected: dict) -> tuple[Any, dict[str, tuple[str, str]]]:
    """`state` (ShapeDtypeStructs) with each optimizer array in the dtype the checkpoint
    record `expected` ({name: {shape, dtype}}) gives it, and {name: (saved, run's dtype)}
    of those that differ; Damaged for an array absent or of another shape or dtype."""
    casts = {}
    leaves = jax.tree.leaves(state)
    out = []
    for leaf, (name, (shape, dtype)) in zip(leaves, checksums.shapes(state).items(), strict=True):
        saved = expected.get(name)
        if saved is None:
            raise Damaged(f"state/{name}", "not in the checkpoint")
        same_shape = saved["shape"] == shape
        if same_shape and saved["dtype"] == dtype:
            out.append(leaf)
            continue
        if (
            same_shape
            and name.startswith(CASTABLE_PREFIX)
            and _floating(saved["dtype"])
            and _floating(dtype)
        ):
            casts[name] = (saved["dtype"], dtype)
            out.append(jax.ShapeDtypeStruct(leaf.shape, saved["dtype"], sharding=leaf.sharding))
            continue
        raise Damaged(
            f"state/{name}",
            f"{saved['dtype']}{saved['shape']} in the checkpoint, the model has {dtype}{shape}",
        )
    return jax.tree.unflatten(jax.tree.structure(state), out), casts


def cast_like(restored: Any, state: Any) -> Any:
    """`restored` with each array in `state`'s dtype (and its own sharding)."""

    def one(x, want):
        if x.dtype == want.dtype:
            return x
        return jax.device_put(x.astype(want.dtype), x.sharding)

    return jax.tree.map(one, restored, state)


def describe(casts: dict[str, tuple[str, str]]) -> str:
    """'N optimizer arrays cast float32 -> bfloat16 (...)', one phrase per dtype pair."""
    pairs: dict[tuple[str, str], int] = {}
    for pair in casts.values():
        pairs[pair] = pairs.get(pair, 0) + 1
    return ", ".join(f"{n} optimizer arrays cast {a} -> {b}" for (a, b), n in pairs.items())
