"""pspec_tags: PartitionSpec algebra and sharding helpers that keep reduced/unreduced tags."""

from pspec_tags.carry import carry_reduced_axes
from pspec_tags.guards import TagLostError, check_unreduced, find_untagged
from pspec_tags.logical import batch_mesh_axes, logical_to_spec
from pspec_tags.ops import (
    MODES,
    broadcast_param,
    embed_lookup,
    shard,
    to_varying,
    unreduced_sum,
    varying_axes,
)
from pspec_tags.specs import (
    check_spec,
    entry_axes,
    entry_from_axes,
    fit_to_shape,
    mesh_axes_used,
    partitions,
    reduced_axes,
    remove_size_one_mesh_axes,
    truncate,
    unreduced_axes,
    untagged,
    with_reduced,
    with_unreduced,
    without_axes,
)
from pspec_tags.values import is_explicit, spec_of

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "TagLostError",
    "batch_mesh_axes",
    "broadcast_param",
    "carry_reduced_axes",
    "check_spec",
    "check_unreduced",
    "embed_lookup",
    "entry_axes",
    "entry_from_axes",
    "find_untagged",
    "fit_to_shape",
    "is_explicit",
    "logical_to_spec",
    "mesh_axes_used",
    "partitions",
    "reduced_axes",
    "remove_size_one_mesh_axes",
    "shard",
    "spec_of",
    "to_varying",
    "truncate",
    "unreduced_axes",
    "unreduced_sum",
    "untagged",
    "varying_axes",
    "with_reduced",
    "with_unreduced",
    "without_axes",
]
