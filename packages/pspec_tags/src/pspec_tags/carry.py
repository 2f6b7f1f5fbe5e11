"""Carrying a value's `reduced` tag onto a spec rebuilt from logical rules."""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

from pspec_tags.specs import mesh_axes_used, reduced_axes, with_reduced
from pspec_tags.values import spec_of


def carry_reduced_axes(spec: P | None, value: Any) -> P | None:
    """`spec` plus the `reduced` axes of `value`'s own sharding.

    Code that rebuilds a spec from logical axis rules (a shard_map in_spec, a
    reshard target) produces an untagged spec; resharding a reduced parameter
    onto it silently drops it off the deferred-reduction path, and inside
    `jax.shard_map` its cotangent gets psum'd per call. This copies the tag back.

    Declines (returns `spec` unchanged) when `value` has no explicit sharding
    (auto mode: a no-op), carries no reduced axes, or when a reduced axis also
    partitions `spec` (PartitionSpec rejects that overlap).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> w_D = jax.device_put(jnp.ones(4), NamedSharding(mesh, P(None, reduced={"data"})))
    >>> pt.carry_reduced_axes(P(None), w_D)  # P(None) rebuilt from rules, say
    P(None, reduced={'data'})
    """
    source = spec_of(value)
    if source is None:
        return spec
    tag = reduced_axes(source)
    if not tag or tag & set(mesh_axes_used(spec)):
        return spec
    # TAG: the value's reduced axes back on the rebuilt spec: without them the
    # reshard or shard_map this spec feeds reduces the gradient per use.
    return with_reduced(spec if spec is not None else P(), tag)
