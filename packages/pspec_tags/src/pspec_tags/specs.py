"""PartitionSpec algebra that never drops `reduced`/`unreduced` tags.

A tagged PartitionSpec (one with a non-empty `reduced` or `unreduced` set)
refuses indexing, slicing, unpacking and iteration: JAX raises "Using pspec[...]
is dangerous". Every function here therefore reads entries through
`spec.partitions` and rebuilds specs with `_rebuild`, which copies both tag sets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

Entry = Any  # None | str | tuple[str, ...] | P.UNCONSTRAINED


def partitions(spec: P | None) -> tuple[Entry, ...]:
    """The spec's per-dimension entries, read through any tags; `None` -> `()`.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.partitions(P("fsdp", None, reduced={"data"}))
    ('fsdp', None)
    """
    if spec is None:
        return ()
    if isinstance(spec, P):
        # TAG: `.partitions` is the only tag-safe view: `tuple(spec)` raises on tagged specs.
        return tuple(spec.partitions)
    return tuple(spec)


def reduced_axes(spec: P | None) -> frozenset[str]:
    """Mesh axes over which the spec's value is `reduced` (already summed).

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.reduced_axes(P("fsdp", reduced={"data"}))
    frozenset({'data'})
    """
    return frozenset(getattr(spec, "reduced", None) or ())


def unreduced_axes(spec: P | None) -> frozenset[str]:
    """Mesh axes over which the spec's value is `unreduced` (per-device partial sums).

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.unreduced_axes(P(unreduced={"data"}))
    frozenset({'data'})
    """
    return frozenset(getattr(spec, "unreduced", None) or ())


def entry_axes(entry: Entry) -> tuple[str, ...]:
    """The mesh axes one spec entry names, as a tuple (`None` and `UNCONSTRAINED`
    name none); the inverse of `entry_from_axes`.

    Example:

    >>> from jax.sharding import PartitionSpec as P
    >>> import pspec_tags as pt
    >>> [pt.entry_axes(e) for e in pt.partitions(P("data", ("fsdp", "expert"), None))]
    [('data',), ('fsdp', 'expert'), ()]
    """
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def entry_from_axes(axes: Sequence[str]) -> Entry:
    """The canonical spec entry for a run of mesh axes: `None`, a name, or a tuple;
    the inverse of `entry_axes`.

    Example:

    >>> import pspec_tags as pt
    >>> [pt.entry_from_axes(a) for a in ((), ["data"], ("fsdp", "expert"))]
    [None, 'data', ('fsdp', 'expert')]
    """
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _rebuild(
    spec: P | None,
    entries: Iterable[Entry],
    *,
    reduced: Iterable[str] | None = None,
    unreduced: Iterable[str] | None = None,
) -> P:
    """A new spec with `entries`, keeping `spec`'s tags unless new ones are given."""
    red = frozenset(reduced) if reduced is not None else reduced_axes(spec)
    unred = frozenset(unreduced) if unreduced is not None else unreduced_axes(spec)
    entries = tuple(entries)
    _check_tags_disjoint(entries, red, unred)
    # TAG: both tag sets copied onto the rebuilt spec: every helper here keeps them.
    return P(*entries, reduced=red, unreduced=unred)


def _check_tags_disjoint(entries: tuple, red: frozenset, unred: frozenset) -> None:
    used = {a for e in entries for a in entry_axes(e)}
    for name, tagged in (("reduced", red), ("unreduced", unred)):
        overlap = sorted(tagged & used)
        if overlap:
            raise ValueError(
                f"{name} axis {overlap[0]!r} also partitions a dimension of "
                f"P{entries}: a mesh axis cannot be both (overlap: {overlap})"
            )
    both = sorted(red & unred)
    if both:
        raise ValueError(f"mesh axis {both[0]!r} cannot be both reduced and unreduced")


def with_reduced(spec: P | None, axes: Iterable[str]) -> P:
    """`spec` with `axes` added to its `reduced` set (ValueError on overlap).

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.with_reduced(P("fsdp", None), {"data"})
    P('fsdp', None, reduced={'data'})
    """
    # TAG: the spec's own reduced axes plus `axes` (added, never replaced).
    return _rebuild(spec, partitions(spec), reduced=reduced_axes(spec) | frozenset(axes))


def with_unreduced(spec: P | None, axes: Iterable[str]) -> P:
    """`spec` with `axes` added to its `unreduced` set (ValueError on overlap).

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.unreduced_axes(pt.with_unreduced(P(), {"data"}))
    frozenset({'data'})
    """
    # TAG: the spec's own unreduced axes plus `axes` (added, never replaced).
    return _rebuild(spec, partitions(spec), unreduced=unreduced_axes(spec) | frozenset(axes))


def untagged(spec: P | None) -> P:
    """`spec` without `reduced`/`unreduced` tags (what auto mode can carry).

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.untagged(P("fsdp", None, reduced={"data"}))
    P('fsdp', None)
    """
    return P(*partitions(spec))


def mesh_axes_used(spec: P | None) -> tuple[str, ...]:
    """Mesh axes that partition some dimension, in order of appearance (tags excluded).

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.mesh_axes_used(P(("data", "fsdp"), None, reduced={"expert"}))
    ('data', 'fsdp')
    """
    return tuple(a for e in partitions(spec) for a in entry_axes(e))


def _mesh_sizes(mesh: Any) -> Mapping[str, int]:
    # Mesh and AbstractMesh both expose `.shape` as an ordered name -> size mapping.
    return dict(mesh.shape)


def check_spec(spec: P | None, *, ndim: int | None = None, mesh: Any = None) -> None:
    """Raise ValueError naming the spec and the offending axis when `spec` is unusable.

    Checks: more entries than `ndim`; a mesh axis (in entries or tags) absent
    from `mesh`; a mesh axis used twice; a tag overlapping the partitions.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.check_spec(P("model"), mesh=AbstractMesh((4, 2), ("data", "fsdp")))
    Traceback (most recent call last):
    ...
    ValueError: spec P('model',) names mesh axis 'model', which is not in the mesh ...
    """
    entries = partitions(spec)
    if ndim is not None and len(entries) > ndim:
        raise ValueError(f"spec {spec} has {len(entries)} entries but the array has rank {ndim}")
    used = mesh_axes_used(spec)
    seen: set[str] = set()
    for axis in used:
        if axis in seen:
            raise ValueError(f"spec {spec} uses mesh axis {axis!r} for more than one dimension")
        seen.add(axis)
    if mesh is not None:
        sizes = _mesh_sizes(mesh)
        for axis in (*used, *sorted(reduced_axes(spec) | unreduced_axes(spec))):
            if axis not in sizes:
                raise ValueError(
                    f"spec {spec} names mesh axis {axis!r}, which is not in the mesh "
                    f"(axes: {tuple(sizes)})"
                )
    _check_tags_disjoint(entries, reduced_axes(spec), unreduced_axes(spec))


def remove_size_one_mesh_axes(spec: P | None, mesh: Any) -> P | None:
    """Drop mesh axes of size one from every entry; tags are kept as they are.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = AbstractMesh((4, 1), ("data", "fsdp"))
    >>> pt.remove_size_one_mesh_axes(P(("data", "fsdp"), None), mesh)
    P('data', None)
    """
    if spec is None:
        return None
    check_spec(spec, mesh=mesh)
    sizes = _mesh_sizes(mesh)

    def keep(entry: Entry) -> Entry:
        if entry is P.UNCONSTRAINED:
            return entry
        return entry_from_axes([a for a in entry_axes(entry) if sizes[a] != 1])

    return _rebuild(spec, (keep(e) for e in partitions(spec)))


def without_axes(spec: P | None, axes: Iterable[str]) -> P | None:
    """Drop `axes` from every entry (those dims are then whole over them); tags kept.

    Example:

    >>> from jax.sharding import PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.without_axes(P("stage", ("expert", "tensor"), reduced={"data"}), {"tensor"})
    P('stage', 'expert', reduced={'data'})
    """
    if spec is None:
        return None
    drop = frozenset(axes)

    def keep(entry: Entry) -> Entry:
        if entry is P.UNCONSTRAINED:
            return entry
        return entry_from_axes([a for a in entry_axes(entry) if a not in drop])

    # TAG: _rebuild copies the reduced/unreduced sets: only the entries change.
    return _rebuild(spec, (keep(e) for e in partitions(spec)))


def fit_to_shape(spec: P | None, shape: Sequence[int], mesh: Any) -> P | None:
    """Shard each dimension over the longest prefix of its mesh axes that divides it.

    A dimension of size 6 with entry ('data', 'fsdp') on data=2, fsdp=4 keeps
    'data' only; one that no axis divides becomes `None`. Tags are kept.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> mesh = AbstractMesh((4, 2), ("data", "fsdp"))
    >>> pt.fit_to_shape(P("data", "fsdp"), (6, 4), mesh)  # 4 does not divide 6
    P(None, 'fsdp')
    """
    if spec is None:
        return None
    check_spec(spec, ndim=len(shape), mesh=mesh)
    sizes = _mesh_sizes(mesh)

    def fit(entry: Entry, dim: int) -> Entry:
        if entry is P.UNCONSTRAINED:
            return entry
        kept: list[str] = []
        for axis in entry_axes(entry):
            if dim % (math.prod(sizes[a] for a in kept) * sizes[axis]) != 0:
                break
            kept.append(axis)
        return entry_from_axes(kept)

    return _rebuild(spec, (fit(e, d) for e, d in zip(partitions(spec), shape, strict=False)))


def truncate(spec: P | None, ndim: int) -> P | None:
    """The first `ndim` entries of `spec` (for outputs of lower rank), tags kept.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> pt.truncate(P("fsdp", None, reduced={"data"}), 1)
    P('fsdp', reduced={'data'})
    """
    if spec is None:
        return None
    return _rebuild(spec, partitions(spec)[:ndim])
