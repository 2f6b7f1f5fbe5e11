"""LoRA factors on the expert kernels: names, logical axes, shapes, and the merge.

A kernel W in `LORA_TARGETS` (lead..., in, out; lead is the routed experts' E dim) may
come with two factors in the layer's params: `<kernel>_lora_a` (lead..., in, r) and
`<kernel>_lora_b` (lead..., r, out). The layer then uses W + config.lora_scale x A @ B,
merged per shard inside its shard_map after the FSDP gathers, so the factors' gather
transposes reduce-scatter factor-sized cotangents, never a kernel-sized one.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_kernels.config import MoEConfig
from pspec_tags import reduced_axes, to_varying

LORA_TARGETS = ("wi_0", "wi_1", "wo", "shared_wi_0", "shared_wi_1", "shared_wo")
SUFFIXES = ("_lora_a", "_lora_b")


def param_names() -> tuple[str, ...]:
    """Every name a LoRA factor may have in the layer's params."""
    return tuple(k + s for k in LORA_TARGETS for s in SUFFIXES)


def base_name(name: str) -> str:
    """The kernel a LoRA factor's name belongs to (any other name: itself)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in LORA_TARGETS:
            return name[: -len(suffix)]
    return name


def logical_axes_of(config: MoEConfig, name: str) -> tuple[str | None, ...]:
    """A parameter's logical axes; a LoRA factor's follow its kernel's, with the
    rank dim replicated (None): A keeps the input side, B the output side."""
    kernel = base_name(name)
    axes = config.logical_axes[kernel]
    if name == kernel + SUFFIXES[0]:
        return (*axes[:-1], None)
    if name == kernel + SUFFIXES[1]:
        return (*axes[:-2], None, axes[-1])
    return axes


def factor_shapes(params: Mapping, shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """The shapes the LoRA factors in `params` must have, given the kernels' `shapes`
    (ValueError for half a pair or factors of a kernel the layer lacks)."""
    out = {}
    for kernel in LORA_TARGETS:
        a, b = (kernel + s for s in SUFFIXES)
        if a not in params and b not in params:
            continue
        if a not in params or b not in params or kernel not in shapes:
            raise ValueError(f"LoRA factors of {kernel!r} need {a!r}, {b!r} and the kernel itself")
        w, r = shapes[kernel], params[a].shape[-1]
        out[a], out[b] = (*w[:-1], r), (*w[:-2], r, w[-1])
    return out


def as_varying(f: jax.Array, spec: P | None) -> jax.Array:
    """A factor inside the shard_map with its in_spec's reduced axes cast to varying:
    the two factors are reduced over different axis sets (B is not gathered over
    FSDP), which JAX's automatic casts do not reconcile. The cast's transpose leaves
    the cotangent unreduced over those axes, as the reduced in_spec promises."""
    axes = tuple(sorted(reduced_axes(spec))) if spec is not None else ()
    # TAG: reduced -> varying over exactly the in_spec's reduced axes (no reduction).
    return to_varying(f, axes) if axes else f


def merged(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, precision) -> jax.Array:
    """W + scale x A @ B in W's dtype (the lead dims batched)."""
    return w + (scale * jnp.matmul(a, b, precision=precision)).astype(w.dtype)
