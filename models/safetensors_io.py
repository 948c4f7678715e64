"""A minimal, validating reader of safetensors checkpoints.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes
of JSON naming each tensor's dtype, shape and ``[begin, end)`` byte range in
the data section, then the raw data. Each file is memory-mapped and tensors
are yielded one at a time as read-only NumPy views, so a loader can move them
to the device one by one without a second full copy in host memory.
"""

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class CheckpointError(ValueError):
    """A checkpoint is malformed or does not match the model; says which file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file (absolute byte offsets)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def read_header(path: Path) -> list[TensorEntry]:
    """Parses and validates the header of ``path`` against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: header claims {header_len} bytes but the file has only {size} (truncated?)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    return [_parse_entry(path, name, info, data_start, size) for name, info in header.items()]


def _parse_entry(path: Path, name: str, info: Any, data_start: int, size: int) -> TensorEntry:
    """Validates one header entry: dtype, shape, and a byte range that fits the file."""
    try:
        dtype_name, (begin, end) = info["dtype"], info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from e
    if dtype_name not in _DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unsupported dtype {dtype_name!r} (supported: {', '.join(_DTYPES)})"
        )
    dtype = _DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] but shape {shape} "
            f"of {dtype_name} needs {expected} bytes"
        )
    if data_start + end > size:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has only "
            f"{size} bytes (truncated file)"
        )
    return TensorEntry(name, dtype, shape, data_start + begin, data_start + end)


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(name, array)`` for each tensor in ``path``, as read-only views of a memory map."""
    entries = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for e in entries:
        yield e.name, data[e.start : e.stop].view(e.dtype).reshape(e.shape)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a HF model directory, via its index when sharded."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        return _shards_from_index(index_path)
    single = model_dir / SINGLE_FILE
    if single.exists():
        return [single]
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _shards_from_index(index_path: Path) -> list[Path]:
    """The distinct shard files an index names, each checked to exist."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from e
    shards = [index_path.parent / name for name in shard_names]
    for shard in shards:
        if not shard.is_file():
            raise CheckpointError(f"{index_path}: names shard {shard.name!r}, which does not exist")
    return shards
