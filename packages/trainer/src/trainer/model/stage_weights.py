"""How a pipeline's weights enter its fully manual map (model/pipeline.py and
model/pipeline_ends.py): with their own specs, tags included; cast to vary over
the token axes before the loop; gathered over the FSDP axes inside the map, once per
step; and, for what runs whole over 'tensor', gathered over it before the map."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import pspec_tags as pt
from trainer.sharding import ShardCtx

# Sub-modules of a stage's layer that run whole over 'tensor': the MoE block, as it
# does outside the pipeline (moe_kernels' shard_map gathers its kernels over 'tensor'
# there). Their weights are gathered over it once per step, before the map. The
# attention splits its heads over 'tensor' (Megatron's tensor parallelism: the
# einsums' partial sums psummed by ShardCtx.einsum, in the loop).
TENSOR_AXIS = "tensor"
WHOLE_OVER_TENSOR = ("ffn",)
# Mesh axes that shard weights the stages gather once per step (fully sharded data
# parallelism: they shard the batch too).
FSDP_AXES = ("dcn_fsdp", "fsdp")


def own_spec(value: jax.Array, logical: tuple, ctx: ShardCtx) -> P:
    """`value`'s own spec, tags included (explicit mode), or its logical one (auto)."""
    spec = pt.spec_of(value)
    if spec is not None:
        # TAG: the value's spec as it is, `reduced` included: shard_map refuses any
        # other, and without it the cotangent would be psummed over 'data' per use.
        return spec
    return ctx.spec(logical, value.shape)


def whole_over_tensor(
    values: Any, specs: Any, ctx: ShardCtx, where: Callable[[tuple], bool] = lambda path: True
) -> tuple[Any, Any]:
    """`values` (a tree of arrays or Variables) and their in_`specs` (P leaves where
    `values` has arrays or Variables), the leaves at a path `where` accepts gathered
    over 'tensor' before the map (once per step) and their specs without it; the others
    as they are. A mesh without 'tensor': both unchanged."""
    if dict(ctx.mesh.shape).get(TENSOR_AXIS, 1) == 1:
        return values, specs

    def spec(path, s):
        # TAG: without_axes keeps `reduced`: the cotangent leaves the map unreduced
        # over 'data' and the gather's transpose only slices it (no reduction).
        return pt.without_axes(s, (TENSOR_AXIS,)) if where(path) else s

    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs = jax.tree_util.tree_map_with_path(spec, specs, is_leaf=is_spec)
    if ctx.explicit:
        # An explicit shard_map takes its inputs already on its in_specs. (specs
        # first: their P leaves stand where `values` holds arrays or Variables.)
        values = jax.tree_util.tree_map_with_path(
            lambda path, s, v: (
                jax.tree.map(lambda w: jax.sharding.reshard(w, s), v) if where(path) else v
            ),
            specs,
            values,
            is_leaf=is_spec,
        )
    return values, specs


def whole_over_tensor_leaf(path: tuple) -> bool:
    """Whether the leaf at `path` (a stage layer's, or the model's: jax key path) is in
    a WHOLE_OVER_TENSOR sub-module (its weights enter the stages whole over 'tensor')."""
    return any(getattr(k, "key", None) in WHOLE_OVER_TENSOR for k in path)


def gather_fsdp(w: jax.Array, spec: P) -> jax.Array:
    """This device's shard of a stacked weight gathered whole over the FSDP axes (the
    dims `spec` shards over them); 'stage' and 'expert' stay sharded. Once per step,
    before the loop: its transpose, the FSDP reduce-scatter of the gradient, runs once
    after the backward loop. check_pipeline refuses tensor_transpose, the one axis
    that could share an entry with them, so each gathered entry is FSDP axes only."""
    for dim, entry in enumerate(pt.partitions(spec)):
        axes = tuple(a for a in pt.entry_axes(entry) if a in FSDP_AXES)
        if axes:
            w = lax.all_gather(w, pt.entry_from_axes(axes), axis=dim, tiled=True)
    return w


def varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` (inside the shard_map) typed varying over each of `axes` it is not yet."""
    have = pt.varying_axes(x)
    extra = tuple(a for a in axes if a not in have)
    return pt.to_varying(x, extra) if extra else x
