"""Reading the sharding JAX attached to a value (traced or concrete)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def spec_of(value: Any) -> P | None:
    """The PartitionSpec in `value`'s type on an Explicit mesh, else None.

    Works on tracers at trace time and on concrete arrays. Only explicit mesh
    axes carry `reduced`/`unreduced`, so an all-Auto mesh gives None.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> x_BxD = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> pt.spec_of(x_BxD)
    P('data', None)
    >>> pt.spec_of(jnp.ones(3)) is None  # one device, no explicit mesh
    True
    """
    try:
        sharding = jax.typeof(value).sharding
    except (TypeError, AttributeError):
        return None
    if not isinstance(sharding, NamedSharding):
        return None
    if not any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    return sharding.spec


def is_explicit(value: Any) -> bool:
    """Whether `value` lives on a mesh with at least one Explicit axis.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> x_BxD = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> pt.is_explicit(x_BxD), pt.is_explicit(jnp.ones(3))
    (True, False)
    """
    return spec_of(value) is not None
