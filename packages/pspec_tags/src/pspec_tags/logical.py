"""Logical axis names -> mesh PartitionSpecs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

from pspec_tags.specs import entry_axes, entry_from_axes

Rules = Sequence[tuple[str, Any]] | Mapping[str, Any]


def _rule_list(rules: Rules) -> list[tuple[str, Any]]:
    return list(rules.items()) if isinstance(rules, Mapping) else list(rules)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules, mesh: Any) -> P:
    """Map logical axis names to an (untagged) PartitionSpec for `mesh`.

    `rules` is an ordered list of `(logical_name, mesh_axes)`; a name may have
    several rules and the first one with a usable mesh axis wins. Mesh axes that
    are absent from the mesh, of size one, or already used by an earlier
    dimension are skipped, so one rule set serves every mesh. A logical name
    with no rule at all raises ValueError (a typo would silently replicate).
    The result is untagged by construction: callers that need a value's tag
    back use `carry_reduced_axes`.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> rules = [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")]
    >>> pt.logical_to_spec(("batch", "embed"), rules, AbstractMesh((4, 2), ("data", "fsdp")))
    P(('data', 'fsdp'), None)
    >>> pt.logical_to_spec(("embed", "mlp"), rules, AbstractMesh((4, 2), ("data", "fsdp")))
    P('fsdp', None)
    """
    sizes = dict(mesh.shape)
    rule_list = _rule_list(rules)
    known = {name for name, _ in rule_list}
    used: set[str] = set()
    entries: list[Any] = []
    for name in logical_axes:
        if name is None or name is P.UNCONSTRAINED:
            entries.append(name)
            continue
        if name not in known:
            raise ValueError(
                f"logical axis {name!r} has no rule (known: {sorted(known)}); "
                f"add ({name!r}, None) to replicate it"
            )
        chosen: tuple[str, ...] = ()
        for rule_name, mesh_axes in rule_list:
            if rule_name != name:
                continue
            chosen = tuple(
                a for a in entry_axes(mesh_axes) if sizes.get(a, 1) > 1 and a not in used
            )
            if chosen:
                break
        used.update(chosen)
        entries.append(entry_from_axes(chosen))
    return P(*entries)


def batch_mesh_axes(mesh: Any, rules: Rules, batch_axis: str = "activation_batch") -> tuple:
    """Mesh axes (of size > 1) that shard the batch, per the logical rules.

    Example:

    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> import pspec_tags as pt
    >>> rules = [("activation_batch", ("data", "fsdp"))]
    >>> pt.batch_mesh_axes(AbstractMesh((4, 1), ("data", "fsdp")), rules)
    ('data',)
    """
    # TAG: `.partitions`, not unpacking the spec: the tag-safe read every helper uses.
    (entry,) = logical_to_spec((batch_axis,), rules, mesh).partitions
    return entry_axes(entry)
