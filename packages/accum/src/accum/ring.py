"""Reduce-scatter as a ring of collective-permutes, for gradients of one bucket.

XLA:TPU runs a reduce-scatter synchronously on v5e whatever the flags (libtpu
0.0.42.1), so ZeRO-1's per-layer reduce-scatters in the overlapped backward
scan cannot hide under compute there; collective-permutes are asynchronous on
every TPU generation. A ring reduce-scatter over n devices is n-1 permutes of
one shard each, every device adding its own partial sum of the shard it passes
on: (n-1)/n of the gradient per device on the wire, what a reduce-scatter
moves, and each permute a start/done pair the scheduler can put compute between.

`ring_reduce_scatter(totals, owns, destinations, dims)` reduces several
per-device partial sums (unreduced) onto their ZeRO-1 shards in one ring: row j
of the ring is every total's shard j along its scatter dim, flattened and joined
(T elements), so a layer's gradients take n-1 permutes in all, not n-1 each.
Each step reads its row out of the totals: one row is live at a time, not an
(n, T) copy of the layer.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _ring(row: Callable[[jax.Array], jax.Array], n: int, axes: tuple[str, ...]) -> jax.Array:
    """Row i of the sum over `axes` of every device's rows, on the device at ring
    position i (its linear index over `axes`, major to minor as a spec's tuple);
    `row(j)` is this device's row j (its partial sum of device j's shard).

    Device i starts with row i-1 and sends it on; at step k it receives the
    running sum of row i-1-k from device i-1 and adds its own; after n-1 steps
    row i has passed through every device and ends on device i.
    """
    me = lax.axis_index(axes)
    forward = [(j, (j + 1) % n) for j in range(n)]
    running_T = row((me - 1) % n)
    for k in range(1, n):
        running_T = lax.ppermute(running_T, axes, forward) + row((me - 1 - k) % n)
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
        # Row j: shard j along each block's scatter dim, flattened, the blocks'
        # joined. Read straight out of the blocks at each step (one row live at
        # a time, not an (n, T) copy of the whole layer).
        def row(j):
            return jnp.concatenate(
                [
                    lax.dynamic_slice_in_dim(b, j * (b.shape[d] // n), b.shape[d] // n, d).ravel()
                    for b, d in zip(blocks, dims, strict=True)
                ]
            )

        mine_T = _ring(row, n, axes)
        if rest:
            mine_T = lax.psum(mine_T, rest)
        out, start = [], 0
        for b, d in zip(blocks, dims, strict=True):
            shard = b.shape[:d] + (b.shape[d] // n,) + b.shape[d + 1 :]
            width = b.size // n
            out.append(mine_T[start : start + width].reshape(shard))
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
