"""One MoE layer's parameters: names, shapes, initial values and their specs
from logical axis rules, and the check `sparse_moe` / `dense_moe` run on them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_kernels import lora
from moe_kernels.config import MoEConfig, fitting_expert_counts
from pspec_tags import entry_axes, fit_to_shape, logical_to_spec, partitions

EXPERT_PARAMS = ("wi_0", "wi_1", "wo")
SHARED_PARAMS = ("shared_wi_0", "shared_wi_1", "shared_wo")

Params = Mapping[str, jax.Array]


def param_shapes(config: MoEConfig, embed_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter of one layer (shared experts only when configured)."""
    e, d, f = config.num_experts, embed_dim, config.mlp_dim
    shapes = {
        "gate": (d, e),
        "bias": (e,),
        "wi_0": (e, d, f),
        "wi_1": (e, d, f),
        "wo": (e, f, d),
    }
    if config.shared_dim:
        fs = config.shared_dim
        shapes.update(shared_wi_0=(d, fs), shared_wi_1=(d, fs), shared_wo=(fs, d))
    return shapes


def init_params(
    key: jax.Array, config: MoEConfig, embed_dim: int, dtype: Any = jnp.float32
) -> dict[str, jax.Array]:
    """Unsharded parameters: fan-in scaled normals, zero routing bias."""
    shapes = param_shapes(config, embed_dim)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes)), strict=True))
    params = {}
    for name, shape in shapes.items():
        if name == "bias":
            params[name] = jnp.zeros(shape, dtype)
            continue
        fan_in = shape[-2]
        params[name] = (jax.random.normal(keys[name], shape) / math.sqrt(fan_in)).astype(dtype)
    return params


def param_specs(
    config: MoEConfig,
    rules: Any,
    mesh: Any,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, P]:
    """Untagged specs of every parameter from `config.param_axes` and logical `rules`.

    With `shapes`, each spec is fitted to its shape (axes that don't divide a
    dimension are dropped), except that an expert dim sharded over the expert
    axis must divide: `num_experts` not divisible by it raises ValueError.
    Use them to place parameters; `sparse_moe` derives the same specs.
    """
    names = shapes if shapes is not None else config.logical_axes
    specs = {}
    for name in names:
        spec = logical_to_spec(lora.logical_axes_of(config, name), rules, mesh)
        if shapes is not None:
            if lora.base_name(name) in EXPERT_PARAMS:
                _check_expert_dim(spec, shapes[name][0], config, mesh)
            spec = fit_to_shape(spec, shapes[name], mesh)
        specs[name] = spec
    return specs


def _check_expert_dim(spec: P, num_experts: int, config: MoEConfig, mesh: Any) -> None:
    entry = partitions(spec)[0] if partitions(spec) else None
    axes = entry_axes(entry)
    if not axes:
        return
    if axes != (config.expert_axis,):
        raise ValueError(
            f"the expert dim of the expert kernels is sharded over {axes}; only the expert "
            f"axis {config.expert_axis!r} may shard it (check the rule for "
            f"{config.logical_axes['wi_0'][0]!r})"
        )
    size = dict(mesh.shape)[config.expert_axis]
    if num_experts % size:
        fits = ", ".join(map(str, fitting_expert_counts(num_experts, size)))
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the size {size} of the mesh axis "
            f"{config.expert_axis!r} that shards the experts; nearest that fit: {fits}"
        )


def check_params(params: Params, config: MoEConfig, embed_dim: int, expert_shards: int = 1) -> None:
    """ValueError naming a missing, extra or misshapen parameter. `expert_shards`: the
    routed kernels hold 1/expert_shards of the experts (a manual expert axis)."""
    want = param_shapes(config, embed_dim)
    for name in EXPERT_PARAMS:
        want[name] = (want[name][0] // expert_shards, *want[name][1:])
    want.update(lora.factor_shapes(params, want))
    optional = {"bias"}
    for name, shape in want.items():
        if name not in params:
            if name in optional:
                continue
            raise ValueError(f"params lack {name!r} (shape {shape}); have {sorted(params)}")
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"param {name!r} has shape {tuple(params[name].shape)}, expected {shape} for "
                f"num_experts={config.num_experts}, embed_dim={embed_dim}, "
                f"mlp_dim={config.mlp_dim}, shared_dim={config.shared_dim}"
            )
    extra = sorted(set(params) - set(want))
    if extra:
        raise ValueError(f"unexpected params {extra}; expected {sorted(want)}")
