"""The runner's side of a connector's copies: its gather and scatter programs, by bucket of blocks."""

from __future__ import annotations

import concurrent.futures
import os

import jax
import numpy as np

from jaxrunner.runner.compilation import CompilationManager
from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.kv_connector.block_stores import BlockData

_COPY_THREADS = concurrent.futures.ThreadPoolExecutor(
    max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="kv-block-copy"
)
"""Threads that lay loaded blocks out for a scatter: numpy's copies release the GIL, and one thread copies a
gigabyte of blocks at a few GB/s, slower than the host-to-device copy that follows."""


class CompiledBlockMover:
    """Moves blocks with ``compilation``'s ``kv_gather`` / ``kv_scatter`` programs, in chunks of the largest
    bucket; ``num_blocks`` is the cache's size (a scatter's padding ids point past it)."""

    def __init__(self, compilation: CompilationManager, num_blocks: int):
        self.compilation = compilation
        self.num_blocks = num_blocks

    def _chunks(self, block_ids: list[int]):
        top = self.compilation.kv_block_buckets[-1]
        for start in range(0, len(block_ids), top):
            ids = block_ids[start : start + top]
            yield start, ids, self.compilation.kv_block_bucket(len(ids))

    def gather(self, kv_caches: KVCaches, block_ids: list[int]) -> list[tuple[jax.Array, jax.Array, int]]:
        chunks = []
        for _, ids, bucket in self._chunks(block_ids):
            padded = np.zeros(bucket, np.int32)  # padding reads the null block
            padded[: len(ids)] = ids
            k, v = self.compilation.kv_gather.get(bucket)(kv_caches, padded)
            k.copy_to_host_async()
            v.copy_to_host_async()
            chunks.append((k, v, len(ids)))
        return chunks

    def scatter(self, kv_caches: KVCaches, block_ids: list[int], blocks: list[BlockData]) -> KVCaches:
        for start, ids, bucket in self._chunks(block_ids):
            padded = np.full(bucket, self.num_blocks, np.int32)  # padding lands past the cache: dropped
            padded[: len(ids)] = ids
            k_shape = (blocks[0][0].shape[0], bucket, *blocks[0][0].shape[1:])
            # Uninitialised past the blocks: the padding ids drop those rows.
            k, v = np.empty(k_shape, blocks[0][0].dtype), np.empty(k_shape, blocks[0][1].dtype)

            def place(i, block, k=k, v=v):
                k[:, i], v[:, i] = block

            list(_COPY_THREADS.map(place, range(len(ids)), blocks[start : start + len(ids)]))
            kv_caches = self.compilation.kv_scatter.get(bucket)(kv_caches, padded, k, v)
        return kv_caches
