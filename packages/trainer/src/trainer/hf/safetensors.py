"""Read and write the safetensors format with numpy memory maps (no extra dependency).

A file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and [begin, end) byte offsets into the data that follows,
then the raw little-endian data. A directory holds one `model.safetensors` or
several files named by `model.safetensors.index.json`'s weight_map.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable

import ml_dtypes
import numpy as np

from trainer.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The format's dtype names <-> numpy dtypes (ml_dtypes supplies bf16 and fp8).
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header larger than this is not a safetensors header (the format's own cap).
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ConfigError):
    """A malformed, truncated or missing checkpoint file, or tensors that disagree
    with the config; the message names the file and the tensor. A ConfigError, so
    `train hf_model_path=...` reports it in one line before compiling."""


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: file, dtype, shape and the byte offset of its data."""

    name: str
    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        """The tensor as a read-only memory map (no bytes read until used)."""
        if not self.shape or not math.prod(self.shape):
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.path, self.dtype, "r", self.offset, self.shape)


def _is_int_list(value, length: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    )


def _tensor_ref(path: str, name: str, entry, data_start: int) -> TensorRef:
    """One header entry as a TensorRef; SafetensorsError naming file and tensor when
    a field is missing or malformed."""
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where}: header entry is not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise SafetensorsError(f"{where}: header entry has no {key}")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise SafetensorsError(f"{where} has unsupported dtype {entry['dtype']}")
    if not _is_int_list(entry["shape"]):
        raise SafetensorsError(f"{where}: shape {entry['shape']!r} is not a list of sizes")
    offsets = entry["data_offsets"]
    if not _is_int_list(offsets, 2) or offsets[0] > offsets[1]:
        raise SafetensorsError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    shape = tuple(entry["shape"])
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise SafetensorsError(f"{where}'s offsets do not match its shape")
    return TensorRef(name, path, dtype, shape, data_start + offsets[0])


def read_header(path: str) -> dict[str, TensorRef]:
    """The tensors of one safetensors file, by name; SafetensorsError naming the file
    when it is missing, truncated or its header is malformed."""
    if not os.path.isfile(path):
        raise SafetensorsError(f"{path}: no such safetensors file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated ({size} bytes, no header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"{path}: truncated or not safetensors (header of {length} B)")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise SafetensorsError(f"{path}: malformed header ({err})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + length
    refs = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ref = _tensor_ref(path, name, entry, data_start)
        if ref.offset + ref.nbytes > size:
            raise SafetensorsError(
                f"{path}: truncated: tensor {name} ends at byte {ref.offset + ref.nbytes} of {size}"
            )
        refs[name] = ref
    return refs


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The index's tensor -> file map; SafetensorsError naming the index when it is
    not JSON or has no weight_map of tensor -> file name."""
    try:
        with open(index_path) as f:
            index = json.load(f)
    except ValueError as err:
        raise SafetensorsError(f"{index_path}: not JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{index_path}: no weight_map object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise SafetensorsError(f"{index_path}: tensor {name} maps to {file!r}, not a file")
    return weight_map


def read_directory(directory: str) -> dict[str, TensorRef]:
    """Every tensor of a checkpoint directory (one file, or the files of its index)."""
    index_path = os.path.join(directory, INDEX)
    if os.path.isfile(index_path):
        weight_map = _read_weight_map(index_path)
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, SINGLE)):
        weight_map, files = None, [SINGLE]
    else:
        raise SafetensorsError(f"{directory}: neither {SINGLE} nor {INDEX} found")
    refs: dict[str, TensorRef] = {}
    for name in files:
        refs.update(read_header(os.path.join(directory, name)))
    if weight_map is not None:
        for key, file in weight_map.items():
            if key not in refs:
                raise SafetensorsError(f"{os.path.join(directory, file)}: tensor {key} missing")
    return refs


def _header(specs: list[tuple[str, tuple[int, ...], np.dtype]]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: str, entries: list[tuple[str, Callable[[], np.ndarray], tuple, np.dtype]]):
    """One safetensors file of (name, producer, shape, dtype) entries, each tensor
    produced only when its turn comes (one in memory at a time); written to a
    temporary name, then renamed. Returns the bytes of tensor data written."""
    tmp = path + ".tmp"
    written = 0
    with open(tmp, "wb") as f:
        f.write(_header([(name, shape, dtype) for name, _, shape, dtype in entries]))
        for name, produce, shape, dtype in entries:
            array = produce()
            if array.shape != tuple(shape) or array.dtype != dtype:
                raise SafetensorsError(
                    f"{path}: tensor {name} came out {array.shape} {array.dtype}"
                )
            f.write(np.ascontiguousarray(array).tobytes())
            written += array.nbytes
    os.replace(tmp, path)
    return written


def shard_names(count: int) -> list[str]:
    """transformers' shard file names."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most `max_shard_bytes` (a
    tensor larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json for a sharded checkpoint."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
