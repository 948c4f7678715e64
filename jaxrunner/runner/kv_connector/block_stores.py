"""Where a connector keeps KV blocks outside the device: host memory (bounded, LRU) or files in a directory.

A block is stored under a key (``chain_keys``: a stable hash of its tokens and
everything before them) as its K and V over all layers, each ``[num_layers,
block_size, num_kv_heads, head_dim]`` in the cache's dtype. ``get`` returns
None for a block the store does not hold and raises ``CorruptBlock`` for one it
cannot read back whole: the caller then computes those tokens again.
"""

from __future__ import annotations

import abc
import collections
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Shaped

BlockData = tuple[
    Shaped[np.ndarray | jax.Array, "num_layers block_size num_kv_heads head_dim"],
    Shaped[np.ndarray | jax.Array, "num_layers block_size num_kv_heads head_dim"],
]
"""One block's K and V over all layers: numpy arrays, or JAX arrays in the device's pinned host memory."""

PINNED_HOST = "pinned_host"


def landed(block: tuple[jax.Array, jax.Array]) -> BlockData:
    """A block gathered from the device as a store keeps it: as it is where it was copied to pinned host memory,
    else as numpy arrays (waiting for its copy to the host if it has not arrived)."""
    if block[0].sharding.memory_kind == PINNED_HOST:
        return block
    return np.asarray(block[0]), np.asarray(block[1])


def root_key(extra_key: str | None) -> str:
    """The parent key of a sequence's first block: what besides the tokens its KV depends on (a LoRA adapter)."""
    return f"root:{extra_key}"


def chain_keys(parent: str, token_ids: Sequence[int | str], block_size: int, start: int, stop: int) -> list[str]:
    """The stable keys of full blocks ``start..stop-1`` of ``token_ids``, block ``start - 1``'s key being
    ``parent``: each a SHA-256 of the previous key and the block's ids (an image's hash where it stands,
    ``Request.block_hash_ids``). Stable across processes, unlike Python's ``hash``."""
    keys = []
    for i in range(start, stop):
        parent = hashlib.sha256(
            f"{parent}|{list(token_ids[i * block_size : (i + 1) * block_size])}".encode()
        ).hexdigest()
        keys.append(parent)
    return keys


def tail_key(parent: str, tail: Sequence[int | str]) -> str:
    """The key of a prompt's last, partial block: its tokens after the full blocks, the last keyed ``parent``."""
    return hashlib.sha256(f"tail|{parent}|{list(tail)}".encode()).hexdigest()


class CorruptBlock(ValueError):
    """A stored block that does not read back whole."""


class BlockStore(abc.ABC):
    """Blocks by key."""

    @abc.abstractmethod
    def get(self, key: str) -> BlockData | None:
        """The block, or None where it is missing; ``CorruptBlock`` where it does not read back whole."""

    @abc.abstractmethod
    def put(self, key: str, data: BlockData) -> None:
        """Store the block (OSError where it cannot be written)."""

    @abc.abstractmethod
    def __contains__(self, key: str) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


class HostPool(BlockStore):
    """At most ``num_blocks`` blocks in host memory; a full pool drops its least recently used block."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"The host pool must hold at least one block; got num_cpu_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self._blocks: collections.OrderedDict[str, BlockData] = collections.OrderedDict()
        self.num_evicted = 0

    def get(self, key: str) -> BlockData | None:
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def put(self, key: str, data: BlockData) -> None:
        self._blocks[key] = data
        self._blocks.move_to_end(key)
        while len(self._blocks) > self.num_blocks:
            self._blocks.popitem(last=False)
            self.num_evicted += 1

    def __contains__(self, key: str) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


class DirectoryStore(BlockStore):
    """One ``.npz`` file a block under ``path``, named by its key; files carry their key and a checksum, so a
    truncated or altered file reads as missing."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.npz"

    def get(self, key: str) -> BlockData | None:
        try:
            with np.load(self._file(key), allow_pickle=False) as stored:
                k, v = stored["k"], stored["v"]  # raw bytes: npz holds no bfloat16 or float8
                if str(stored["key"]) != key or str(stored["checksum"]) != _checksum(k, v):
                    raise ValueError("its key or checksum does not match its contents")
                dtype = jnp.dtype(str(stored["dtype"]))
                return k.view(dtype), v.view(dtype)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as error:
            raise CorruptBlock(f"KV block {key} in {self.path} cannot be read: {error}") from error

    def put(self, key: str, data: BlockData) -> None:
        dtype = str(data[0].dtype)
        k, v = (np.ascontiguousarray(a).view(np.uint8) for a in data)
        partial = self.path / f"{key}.partial.npz"
        np.savez(partial, k=k, v=v, key=np.asarray(key), dtype=np.asarray(dtype), checksum=np.asarray(_checksum(k, v)))
        os.replace(partial, self._file(key))  # readers never see half a file

    def __contains__(self, key: str) -> bool:
        return self._file(key).exists()

    def __len__(self) -> int:
        return sum(1 for name in os.listdir(self.path) if name.endswith(".npz") and ".partial" not in name)


def _checksum(k: np.ndarray, v: np.ndarray) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for array in (k, v):
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
