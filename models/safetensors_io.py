"""A minimal, validating reader of safetensors checkpoints and their JSON files.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes
of JSON naming each tensor's dtype, shape and ``[begin, end)`` byte range in
the data section, then the raw data. Each file is memory-mapped and tensors
are yielded one at a time as read-only NumPy views, so a loader can move them
to the device one by one without a second full copy in host memory.

Every error names the file at fault; a sharded checkpoint's index may name
only files inside the checkpoint directory.
"""

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import ml_dtypes
import numpy as np

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
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


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the checkpoint file ``path``; a missing file, or one that is not a JSON object,
    raises ``CheckpointError`` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def check_json_files(model_dir: Path, names: Iterable[str]) -> None:
    """Each file of ``names`` that ``model_dir`` holds must be a JSON object; the first that is not
    raises ``CheckpointError`` naming it."""
    for name in names:
        if (Path(model_dir) / name).exists():
            read_json_object(Path(model_dir) / name)


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
    """The distinct shard files an index names, each checked to lie in the index's directory and to exist."""
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    shards = []
    for name in sorted(set(weight_map.values())):
        if PurePath(name).is_absolute() or ".." in PurePath(name).parts:
            raise CheckpointError(
                f"{index_path}: names shard {name!r}, outside the checkpoint directory; an index may name "
                "only files inside its own directory"
            )
        shard = index_path.parent / name
        if not shard.is_file():
            raise CheckpointError(f"{index_path}: names shard {name!r}, which does not exist ({shard})")
        shards.append(shard)
    return shards
