"""Reduce-scatter as a ring of collective-permutes, for gradients of one bucket.

XLA:TPU runs a reduce-scatter synchronously on v5e whatever the flags (libtpu
0.0.42.1), so ZeRO-1's per-layer reduce-scatters in the overlapped backward
scan cannot hide under compute there; collective-permutes are asynchronous on
every TPU generation. A ring reduce-scatter over n devices is n-1 permutes of
one shard each, every device adding its own partial sum of the shard it passes
on: (n-1)/n of the gradient per device on the wire, what a reduce-scatter
moves, and each permute a start/done pair the scheduler can put compute between.

`ring_reduce_scatter(totals, owns, destinations, dims)` reduces several
per-device partial sums (unreduced) onto their ZeRO-1 shards in one ring: each
one's shard-to-be along its scatter dim is laid out as an (n, T_k) block, the
blocks joined into one (n, T) buffer, so a layer's gradients take n-1 permutes
in all, not n-1 each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pspec_tags import entry_axes, partitions, unreduced_axes


def ring_dim(own: P | None, destination: P | None) -> tuple[int, tuple[str, ...]] | None:
    """(dim, axes) when reducing `own` onto `destination` is a reduce-scatter over
    `axes` onto one dim `own` leaves unsharded; None for any other reduction.

    The unreduced axes that `destination` does not shard are psummed after the
    ring (on the shard: 1/n of the traffic of psumming the whole).
    """
    if own is None or destination is None or not unreduced_axes(own):
        return None
    unreduced = set(unreduced_axes(own))
    source_parts, target_parts = partitions(own), partitions(destination)
    width = max(len(source_parts), len(target_parts))
    source_parts += (None,) * (width - len(source_parts))
    target_parts += (None,) * (width - len(target_parts))
    found = None
    for dim, (src, dst) in enumerate(zip(source_parts, target_parts, strict=True)):
        if src == dst:
            continue
        axes = entry_axes(dst)
        if found is not None or src is not None or not axes or not set(axes) <= unreduced:
            return None
        found = (dim, tuple(axes))
    return found


def ring_size(mesh, axes: tuple[str, ...]) -> int:
    """Devices in the ring over `axes` of `mesh`."""
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _ring(flat_NxT: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Row i of the sum over `axes` of every device's `flat_NxT`, on the device at
    ring position i (its linear index over `axes`, major to minor as a spec's tuple).

    Device i starts with row i-1 and sends it on; at step k it receives the
    running sum of row i-1-k from device i-1 and adds its own; after n-1 steps
    row i has passed through every device and ends on device i.
    """
    n = flat_NxT.shape[0]
    me = lax.axis_index(axes)
    forward = [(j, (j + 1) % n) for j in range(n)]

    def row(offset: int) -> jax.Array:
        return lax.dynamic_index_in_dim(flat_NxT, (me - offset) % n, keepdims=False)

    running_T = row(1)
    for k in range(1, n):
        running_T = lax.ppermute(running_T, axes, forward) + row(1 + k)
    return running_T


def ring_reduce_scatter(
    totals: list[jax.Array], owns: list[P], destinations: list[P], dims: list[int]
) -> list[jax.Array]:
    """Each `totals[k]` (unreduced, spec `owns[k]`) reduced onto `destinations[k]`,
    sharded at `dims[k]` over the ring's axes, all in one ring.

    Every total must share one dtype and one `ring_dim` axes/psum split (the
    caller buckets them so). Per device the totals are plain partial sums, so
    laying them out as rows, joining and splitting them is local.
    """
    _, axes = ring_dim(owns[0], destinations[0])
    rest = tuple(a for a in unreduced_axes(owns[0]) if a not in axes)
    mesh = jax.typeof(totals[0]).sharding.mesh
    n = ring_size(mesh, axes)

    def body(*blocks):
        # Row j of a block: its shard j along the scatter dim (C order after
        # moving that dim first), so ring row i is device i's shard of each.
        rows = [jnp.moveaxis(b, d, 0).reshape(n, -1) for b, d in zip(blocks, dims, strict=True)]
        mine_T = _ring(jnp.concatenate(rows, axis=1), axes)
        if rest:
            mine_T = lax.psum(mine_T, rest)
        out, start = [], 0
        for b, d in zip(blocks, dims, strict=True):
            moved = jnp.moveaxis(b, d, 0).shape
            shard = (moved[0] // n, *moved[1:])
            width = b.size // n
            out.append(jnp.moveaxis(mine_T[start : start + width].reshape(shard), 0, d))
            start += width
        return tuple(out)

    # TAG: in_specs are the totals' own, unreduced tags included (the blocks are
    # partial sums); out_specs the untagged ZeRO-1 shards: the ring is the reduction.
    # check_vma=False: the ring's result varies over `axes` by construction
    # (each device's own shard), which the out_specs state.
    return list(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(owns),
            out_specs=tuple(destinations),
            check_vma=False,
        )(*totals)
    )
