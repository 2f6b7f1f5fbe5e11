"""Checksums of our own for checkpoints: one per array, computed on device, and one per JSON item.

A checkpoint that orbax decodes can still be wrong: a flipped bit inside a
compressed block that still decompresses, an array file copied over from
another step. So each save records, next to orbax's files, a checksum of every
array as it was in memory, and each restore recomputes them on the restored
arrays and compares.

The array checksum is a sum over elements, mod 2**32, of a hash of (the
element's bits, its global flat index), in two lanes with different seeds (64
bits). Sums are order-free, so each device hashes the shards it holds (replica
0 of each) and one all-reduce across devices (and processes) adds them up: the
result does not depend on the sharding, and every process gets the same value.
For a fixed index the hash is a bijection of the bits, so any change to a single
element always changes the sum. Indices wrap at 2**32 elements per array.

It all runs on device, dispatched asynchronously: the step that follows a save
never waits for it (the values are read later, in the save's background thread).
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

LANES = 2
_SEEDS = (0x9E3779B9, 0x7F4A7C15)
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def array_names(tree: Any) -> list[str]:
    """`params.moe_layers.ffn.wi_0`-style names of `tree`'s leaves, in leaf order."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in paths]


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection of uint32 that mixes every bit into every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _shard_sums(shard: jax.Array, offsets: jax.Array, strides: jax.Array) -> jax.Array:
    """uint32[LANES]: the hash sums of one shard, `offsets` its start in the global array.

    Traced offsets and strides: one compile per local shape and dtype, whatever
    the array's place in the global one.
    """
    bits = jax.lax.bitcast_convert_type(shard, _UNSIGNED[shard.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    index = jnp.zeros(shard.shape, jnp.uint32)
    for dim in range(shard.ndim):
        position = jax.lax.broadcasted_iota(jnp.uint32, shard.shape, dim) + offsets[dim]
        index = index + position * strides[dim]
    lanes = [
        jnp.sum(_fmix32(bits ^ _fmix32(index ^ jnp.uint32(s))), dtype=jnp.uint32) for s in _SEEDS
    ]
    return jnp.stack(lanes)


def _strides(shape: Sequence[int]) -> np.ndarray:
    """Row-major element strides of `shape`, mod 2**32 (the hash's index width)."""
    strides = np.ones(len(shape), np.uint64)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return (strides % (1 << 32)).astype(np.uint32)


@functools.lru_cache(maxsize=1 << 14)
def _place_on(device, offsets: tuple, strides: tuple) -> tuple[jax.Array, jax.Array]:
    """A shard's offsets and its array's strides on `device`: the same at every save, so
    kept there (a transfer per shard per save would hold up the training loop)."""
    return jax.device_put((np.array(offsets, np.uint32), np.array(strides, np.uint32)), device)


def _local_sums(leaves: list[jax.Array]) -> dict[Any, list[jax.Array]]:
    """Per local device, one uint32[LANES] per leaf (zeros where it holds no replica-0 shard)."""
    per_device: dict[Any, list] = {d: [None] * len(leaves) for d in jax.local_devices()}
    for i, leaf in enumerate(leaves):
        if leaf.dtype.itemsize not in _UNSIGNED:
            raise TypeError(f"checksums cover 1, 2 and 4-byte dtypes, not {leaf.dtype}")
        strides = tuple(int(x) for x in _strides(leaf.shape))
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue  # another device holds the same values: count them once
            offsets = tuple(s.start or 0 for s in shard.index)
            place = _place_on(shard.device, offsets, strides)
            per_device[shard.device][i] = _shard_sums(shard.data, *place)
    for device, sums in per_device.items():
        zeros = jax.device_put(np.zeros(LANES, np.uint32), device)
        per_device[device] = [zeros if value is None else value for value in sums]
    return per_device


@jax.jit
def _stack(sums: list[jax.Array]) -> jax.Array:
    """One device's sums as its row: uint32[1, leaves, LANES]."""
    return jnp.stack(sums)[None]


@functools.cache
def _device_mesh(devices: tuple) -> jax.sharding.Mesh:
    """Every device on one auto-mode axis: ours, apart from the run's mesh and its tags."""
    return jax.sharding.Mesh(np.array(devices), ("devices",), axis_types=(AxisType.Auto,))


@functools.cache
def _sum_rows(mesh: jax.sharding.Mesh):
    """jit: the rows of every device summed, the result replicated over `mesh`."""
    # TAG: untagged and replicated: a plain all-reduce, nothing deferred on this mesh.
    replicated = NamedSharding(mesh, P())
    return jax.jit(lambda rows: jnp.sum(rows, axis=0, dtype=jnp.uint32), out_shardings=replicated)


def start(tree: Any) -> jax.Array:
    """Dispatch the checksums of every array of `tree`: uint32[leaves, LANES], replicated
    on every device (nothing waits here; read it with `values`)."""
    leaves = jax.tree.leaves(tree)
    mesh = _device_mesh(tuple(jax.devices()))
    # No context mesh: the per-shard programs run on one device each, and a save
    # happens inside the training loop's `set_mesh`, which they would have to match.
    with jax.set_mesh(None):
        per_device = _local_sums(leaves)
        rows = [_stack(per_device[d]) for d in mesh.devices.flat if d in per_device]
        # Our own mesh of all devices, in auto mode: the sum is the one all-reduce
        # (across processes too) and comes back replicated, readable on every process.
        stacked = jax.make_array_from_single_device_arrays(
            (mesh.size, len(leaves), LANES),
            NamedSharding(mesh, P("devices")),  # TAG: one row per device, untagged (auto mesh)
            rows,
        )
        return _sum_rows(mesh)(stacked)


def values(started: jax.Array, names: Sequence[str]) -> dict[str, list[int]]:
    """{array name: [lane sums]} from `start`'s result, `names` in leaf order (waits for
    the device)."""
    table = np.asarray(started.addressable_shards[0].data)
    return {name: [int(x) for x in row] for name, row in zip(names, table, strict=True)}


def of_tree(tree: Any) -> dict[str, list[int]]:
    """`start` then `values`: the checksums of `tree`'s arrays, now."""
    return values(start(tree), array_names(tree))


def of_json(item: Any) -> int:
    """crc32 of a JSON item in canonical form (sorted keys): survives a rewrite by orbax."""
    return zlib.crc32(json.dumps(item, sort_keys=True).encode())


def shapes(tree: Any) -> dict[str, list]:
    """{array name: [shape, dtype name]} of `tree`'s leaves (arrays or ShapeDtypeStructs)."""
    leaves = jax.tree.leaves(tree)
    return {
        name: [list(leaf.shape), str(leaf.dtype)]
        for name, leaf in zip(array_names(tree), leaves, strict=True)
    }
