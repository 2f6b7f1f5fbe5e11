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
    data_start = 8 + length
    refs = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise SafetensorsError(
                f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')}"
            )
        begin, end = entry["data_offsets"]
        shape = tuple(int(n) for n in entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name}'s offsets do not match its shape")
        if data_start + end > size:
            raise SafetensorsError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + end} of {size}"
            )
        refs[name] = TensorRef(name, path, dtype, shape, data_start + begin)
    return refs


def read_directory(directory: str) -> dict[str, TensorRef]:
    """Every tensor of a checkpoint directory (one file, or the files of its index)."""
    index_path = os.path.join(directory, INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise SafetensorsError(f"{index_path}: no weight_map")
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
