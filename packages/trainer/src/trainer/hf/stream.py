"""Stream a HF checkpoint onto the mesh, and a trainer state back into HF tensors.

Import: every tensor is checked (present, shape, dtype, fp8 scale) before any is
read; then each device's slice of each trainer parameter is assembled straight
from the memory-mapped files (only the layers, experts and rows that device
holds) and moved onto the device, so no host copy of the model, or of a whole
stacked parameter, is ever made. fp8 weights are
dequantized on the way. Export walks the arrays' addressable shards one HF
tensor at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from trainer.hf import fp8
from trainer.hf.keys import (
    IGNORED_SUFFIXES,
    SCALE_SUFFIX,
    Leaf,
    is_fp8_weight_of,
    layer_index,
    mtp_depths,
)
from trainer.hf.safetensors import DTYPES, SafetensorsError, TensorRef

FLOAT_DTYPES = {DTYPES[n] for n in ("F32", "BF16", "F16")}
FP8_DTYPE = DTYPES["F8_E4M3"]
BF16 = DTYPES["BF16"]
FINITE_CHUNK = 1 << 20  # elements per step of the NaN/Inf check (a 1 MB temporary)


class Progress:
    """Tensors and bytes done and the rate, on stderr at most every `period_s`."""

    def __init__(self, label: str, tensors: int, nbytes: int, enabled: bool = True, period_s=2.0):
        self.label, self.tensors, self.nbytes = label, tensors, nbytes
        self.enabled, self.period_s = enabled, period_s
        self.done_tensors = self.done_bytes = 0
        self.start = self.last = time.perf_counter()

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        unit, scale = ("GB", 1e9) if self.nbytes >= 1e9 else ("MB", 1e6)
        return (
            f"{self.label}: {self.done_tensors}/{self.tensors} tensors, "
            f"{self.done_bytes / scale:.2f}/{self.nbytes / scale:.2f} {unit}, "
            f"{self.done_bytes / scale / seconds:.2f} {unit}/s, {seconds:.1f} s"
        )

    def add(self, tensors: int, nbytes: int) -> None:
        self.done_tensors += tensors
        self.done_bytes += nbytes
        now = time.perf_counter()
        finished = self.done_tensors >= self.tensors
        if self.enabled and (finished or now - self.last >= self.period_s):
            print(self.line(), file=sys.stderr, flush=True)
            self.last = now


@dataclasses.dataclass
class Plan:
    """What an import reads: per leaf, its HF tensors; plus what it skips."""

    leaves: list[Leaf]
    refs: dict[str, TensorRef]
    skipped: list[str]  # MTP layers' tensors (layer index >= num layers) nothing reads
    ignored: list[str] = dataclasses.field(default_factory=list)  # IGNORED_SUFFIXES

    def nbytes(self, leaf: Leaf) -> int:
        total = 0
        for _, name in leaf.names():
            if name in self.refs:
                total += self.refs[name].nbytes
                scale = self.refs.get(name + SCALE_SUFFIX)
                total += scale.nbytes if scale else 0
        return total


def _where(ref: TensorRef) -> str:
    return f"{ref.path}: tensor {ref.name}"


def check(leaves: list[Leaf], refs: dict[str, TensorRef], num_layers: int, directory: str) -> Plan:
    """Every expected tensor present with its shape and a float dtype (fp8 only with
    its scale); nothing unexpected. SafetensorsError naming file and key otherwise."""
    expected: set[str] = set()
    for leaf in leaves:
        for _, name in leaf.names():
            expected.add(name)
            ref = refs.get(name)
            if ref is None:
                if leaf.optional:
                    continue
                raise SafetensorsError(f"{directory}: tensor {name} missing")
            if ref.shape != leaf.hf_shape:
                raise SafetensorsError(
                    f"{_where(ref)} has shape {list(ref.shape)}, the config (config.json "
                    f"and any explicit keys) needs {list(leaf.hf_shape)}"
                )
            if ref.dtype == FP8_DTYPE and is_fp8_weight_of(name, leaf):
                scale = refs.get(name + SCALE_SUFFIX)
                if scale is None:
                    raise SafetensorsError(f"{_where(ref)} is fp8 without {name + SCALE_SUFFIX}")
                if scale.shape != fp8.scale_shape(ref.shape) or scale.dtype not in FLOAT_DTYPES:
                    raise SafetensorsError(
                        f"{_where(scale)} has shape {list(scale.shape)} {scale.dtype}, expected "
                        f"{list(fp8.scale_shape(ref.shape))} float"
                    )
                expected.add(name + SCALE_SUFFIX)
            elif ref.dtype not in FLOAT_DTYPES:
                raise SafetensorsError(f"{_where(ref)} has unsupported dtype {ref.dtype}")
    skipped, ignored = [], []
    for name, ref in refs.items():
        if name in expected:
            continue
        if name.endswith(IGNORED_SUFFIXES):
            ignored.append(name)
            continue
        index = layer_index(name)
        if index is not None and index >= num_layers:
            skipped.append(name)
            continue
        raise SafetensorsError(f"{_where(ref)} is not a parameter of this config")
    return Plan(leaves, refs, skipped, ignored)


class _Reader:
    """HF tensors as trainer-layout views; the last fp8 tensor's dequantization cached
    (each device's callback asks for it again)."""

    def __init__(self, refs: dict[str, TensorRef]):
        self.refs = refs
        self.cached: tuple[str, np.ndarray] | None = None

    def tensor(self, name: str) -> np.ndarray:
        ref = self.refs[name]
        if ref.dtype != FP8_DTYPE:
            return ref.array()
        if self.cached is None or self.cached[0] != name:
            scale = self.refs[name + SCALE_SUFFIX].array()
            self.cached = (name, fp8.dequantize(ref.array(), scale))
        return self.cached[1]


def _finite(array: np.ndarray) -> bool:
    """Whether every element of a contiguous float array is finite, a chunk at a time
    (no array-sized temporary); bfloat16 by its exponent bits (all ones: Inf or NaN),
    which is several times faster than numpy's isfinite on ml_dtypes' type."""
    flat = array.reshape(-1)
    if flat.dtype == BF16:
        bits = flat.view(np.uint16)
        return not any(
            ((bits[i : i + FINITE_CHUNK] & 0x7F80) == 0x7F80).any()
            for i in range(0, bits.size, FINITE_CHUNK)
        )
    return all(
        np.isfinite(flat[i : i + FINITE_CHUNK]).all() for i in range(0, flat.size, FINITE_CHUNK)
    )


def _region(
    leaf: Leaf, reader: _Reader, index: tuple, dtype: np.dtype, check_finite: bool = True
) -> np.ndarray:
    """The slice `index` of the leaf, read from only the HF tensors it touches;
    SafetensorsError naming file and tensor for a NaN or Inf in it (`check_finite`)."""
    index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
    ranges = [range(*s.indices(n)) for s, n in zip(index, leaf.shape, strict=True)]
    out = np.empty([len(r) for r in ranges], dtype)
    lead, rest = ranges[: leaf.lead], index[leaf.lead :]
    names = dict(leaf.names())
    for pos, ids in zip(
        itertools.product(*[range(len(r)) for r in lead]), itertools.product(*lead), strict=True
    ):
        name = names[ids]
        if name not in reader.refs:  # optional: zeros (e.g. no V2 routing bias)
            out[pos] = 0
            continue
        out[pos] = leaf.to_trainer(reader.tensor(name))[rest]
        if check_finite and not _finite(out[pos]):
            raise SafetensorsError(
                f"{_where(reader.refs[name])} holds NaN or Inf (hf_check_finite=false loads it)"
            )
    return out


def _place(target, read: Callable[[tuple], np.ndarray]) -> jax.Array:
    """An array of `target`'s shape and sharding whose every addressable device
    slice is `read(index)`, each moved to its device as soon as it is read: unlike
    `jax.make_array_from_callback`, which reads every slice before placing any, at
    most one slice is on the host beside what the devices already hold."""
    per_device = target.sharding.addressable_devices_indices_map(target.shape)
    arrays = [jax.device_put(read(index), device) for device, index in per_device.items()]
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, arrays)


def import_leaves(
    plan: Plan, targets: dict[str, dict], progress: bool = True, check_finite: bool = True
) -> dict[str, dict]:
    """Arrays for every leaf, each built on its target's sharding (`targets` mirrors
    the trees with ShapeDtypeStructs carrying shardings); with `check_finite`, a NaN
    or Inf is a SafetensorsError naming file and tensor."""
    reader = _Reader(plan.refs)
    total = sum(plan.nbytes(leaf) for leaf in plan.leaves)
    count = sum(len(leaf.names()) for leaf in plan.leaves)
    bar = Progress("hf import", count, total, progress)
    if plan.skipped and progress:
        why = (
            "copies of the shared embedding and head"
            if mtp_depths(plan.leaves)
            else "MTP is off (mtp_num_layers=0)"
        )
        print(
            f"hf import: skipping {len(plan.skipped)} tensors of the multi-token-prediction "
            f"layers: {why}",
            file=sys.stderr,
        )
    if plan.ignored and progress:
        print(
            f"hf import: ignoring {len(plan.ignored)} rotary_emb.inv_freq tensors: the RoPE "
            "frequencies come from config.json (as in transformers)",
            file=sys.stderr,
        )
    out: dict[str, dict] = {}
    for leaf in plan.leaves:
        target = targets[leaf.tree]
        for key in leaf.path:
            target = target[key]
        dtype = np.dtype(target.dtype)
        array = _place(
            target,
            lambda index, leaf=leaf, dtype=dtype: _region(leaf, reader, index, dtype, check_finite),
        )
        node = out.setdefault(leaf.tree, {})
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = array
        bar.add(len(leaf.names()), plan.nbytes(leaf))
    return out


def _host_tensor(array: jax.Array, lead: tuple[int, ...]) -> np.ndarray:
    """`array[lead]` assembled on the host from the addressable shards holding it."""
    tail = array.shape[len(lead) :]
    out = None
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        index = tuple(shard.index) + (slice(None),) * (array.ndim - len(shard.index))
        starts = [s.indices(n)[0] for s, n in zip(index, array.shape, strict=True)]
        if any(
            not (start <= i < start + n)
            for i, start, n in zip(lead, starts, shard.data.shape, strict=False)
        ):
            continue
        data = np.asarray(shard.data)
        local = tuple(i - start for i, start in zip(lead, starts, strict=False))
        if out is None:
            out = np.empty(tail, data.dtype)
        region = tuple(
            slice(s, s + n)
            for s, n in zip(starts[len(lead) :], data.shape[len(lead) :], strict=True)
        )
        out[region] = data[local]
    return out


def export_tensors(
    leaves: list[Leaf], trees: dict[str, dict], dtype_of: Callable[[Leaf], np.dtype]
) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...], np.dtype]]:
    """(HF name, producer of its host array, shape, dtype) for every HF tensor, in
    file order; a producer gathers only that tensor from the addressable shards (or
    indexes it, for a numpy array: export-hf reads the checkpoint on the host)."""
    for leaf in leaves:
        array = trees[leaf.tree]
        for key in leaf.path:
            array = array[key]
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            raise ValueError(f"{'/'.join(leaf.path)}: export reads arrays one process holds")
        dtype = dtype_of(leaf)
        for lead, name in leaf.names():

            def produce(array=array, lead=lead, leaf=leaf, dtype=dtype):
                host = _host_tensor(array, lead) if isinstance(array, jax.Array) else array[lead]
                return np.ascontiguousarray(leaf.to_hf(host).astype(dtype))

            yield name, produce, leaf.hf_shape, dtype


def directory_size(directory: str) -> int:
    """Bytes of the safetensors files in `directory`."""
    return sum(
        os.path.getsize(os.path.join(directory, n))
        for n in os.listdir(directory)
        if n.endswith(".safetensors")
    )
