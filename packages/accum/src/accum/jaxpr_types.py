"""What a jaxpr variable's type says about the mesh: the axes it is reduced,
unreduced (partial sums) or varying over, how many elements one device holds,
which axes shard given dimensions, and which a dot_general sums over.

Read by the trace-time guard (accum.guard_walk); explicit-mode tags and
shard_map's manual axis types alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

from pspec_tags import entry_axes, partitions, reduced_axes, unreduced_axes


def aval_of(var: Any) -> Any:
    """The abstract value of a jaxpr variable (None where it has none)."""
    return getattr(var, "aval", None)


def var_spec(var: Any) -> P | None:
    """The PartitionSpec of an explicitly sharded variable's type, else None."""
    return getattr(getattr(aval_of(var), "sharding", None), "spec", None)


def manual_axes(var: Any, field: str) -> frozenset[str]:
    """`field` (varying/unreduced/reduced) of the manual-axis type inside shard_map.

    JAX 0.10+ keeps it in `aval.manual_axis_type`; earlier releases kept only
    the varying axes, in `aval.vma`. Neither: nothing manual.
    """
    aval = aval_of(var)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, field, None) or ())
    if field == "varying":
        return frozenset(getattr(aval, "vma", None) or ())
    return frozenset()


def reduced_over(var: Any) -> frozenset[str]:
    """Axes `var` is reduced over: explicit tag or manual axis type."""
    return reduced_axes(var_spec(var)) | manual_axes(var, "reduced")


def unreduced_over(var: Any) -> frozenset[str]:
    """Axes `var` holds per-device partial sums over: explicit tag or manual axis type."""
    return unreduced_axes(var_spec(var)) | manual_axes(var, "unreduced")


def block_elements(var: Any) -> int:
    """Elements of one device's block of `var` (what a collective on it moves)."""
    aval = aval_of(var)
    shape = list(getattr(aval, "shape", ()))
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    sizes = dict(getattr(mesh, "shape", None) or {})
    # Inside shard_map the shape is already the block; its spec names no manual axis.
    for d, entry in enumerate(partitions(var_spec(var))):
        if d < len(shape) and entry is not None:
            for axis in entry_axes(entry):
                shape[d] = -(-shape[d] // sizes.get(axis, 1))
    return math.prod(shape)


def dim_axes(var: Any, dims: Iterable[int]) -> frozenset[str]:
    """Mesh axes sharding dimensions `dims` of `var` (explicit axes only)."""
    parts = partitions(var_spec(var))
    found: set[str] = set()
    for d in dims:
        if d < len(parts) and parts[d] is not None:
            found.update(entry_axes(parts[d]))
    return frozenset(found)


def contraction_sum_axes(eqn: Any) -> frozenset[str]:
    """Mesh axes a dot_general sums partial products over.

    An axis sharding a contracted dimension of one operand means local partial
    sums, unless the other operand shards one of its *free* dimensions over that
    same axis: then the two layouts conflict and the product gathers the first
    operand instead (FSDP's weight all-gather in the backward pass of `x @ w`,
    with `x` batch-sharded over the axis the weight's contracted dim uses). A
    gather moves data and reduces nothing, so it is no deferred reduction.
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[:2]

    def free_axes(var: Any, contracted: Sequence[int], batch: Sequence[int]) -> frozenset[str]:
        ndim = len(getattr(aval_of(var), "shape", ()))
        return dim_axes(var, [d for d in range(ndim) if d not in (*contracted, *batch)])

    lhs_sum = dim_axes(lhs, lhs_c) - free_axes(rhs, rhs_c, rhs_b)
    rhs_sum = dim_axes(rhs, rhs_c) - free_axes(lhs, lhs_c, lhs_b)
    return lhs_sum | rhs_sum


def is_literal(var: Any) -> bool:
    return type(var).__name__ == "Literal"
