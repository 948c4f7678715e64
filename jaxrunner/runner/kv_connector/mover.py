"""The runner's side of a connector's copies: its gather and scatter programs, by bucket of blocks, and where
saved blocks live on the host.

A saved block is a K and a V array in the device's pinned host memory where it
has one (``pinned_host``: the copies to and from it are DMA transfers, with no
staging on the host), else numpy arrays. Loading copies each block to the
device on its own, whichever store it came from, and one program stacks and
scatters them.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrunner.runner.compilation import CompilationManager
from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.kv_connector.block_stores import PINNED_HOST, BlockData


def host_memory(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    """``sharding`` in its devices' pinned host memory, or None where they have none."""
    device = next(iter(sharding.device_set))
    if PINNED_HOST not in {memory.kind for memory in device.addressable_memories()}:
        return None
    return sharding.with_memory_kind(PINNED_HOST)


class CompiledBlockMover:
    """Moves blocks with ``compilation``'s ``kv_gather`` / ``kv_scatter`` programs, in chunks of the largest
    bucket; ``num_blocks`` is the cache's size (a scatter's padding ids point past it); ``block_sharding``
    is how a block lies on the devices: split on KV heads like the cache, so that under tensor parallelism
    each device copies its own shard to and from the host."""

    def __init__(self, compilation: CompilationManager, num_blocks: int, block_sharding: jax.sharding.Sharding):
        self.compilation = compilation
        self.num_blocks = num_blocks
        self.block_sharding = block_sharding
        self.host_sharding = host_memory(block_sharding)

    def _chunks(self, block_ids: list[int]):
        top = self.compilation.kv_block_buckets[-1]
        for start in range(0, len(block_ids), top):
            ids = block_ids[start : start + top]
            yield start, ids, self.compilation.kv_block_bucket(len(ids))

    def gather(self, kv_caches: KVCaches, block_ids: list[int]) -> list[tuple[jax.Array, jax.Array]]:
        """Each block's K and V on their way to the host (``block_stores.landed`` gives them once there)."""
        blocks = []
        for _, ids, bucket in self._chunks(block_ids):
            padded = np.zeros(bucket, np.int32)  # padding reads the null block
            padded[: len(ids)] = ids
            k, v = self.compilation.kv_gather.get(bucket)(kv_caches, padded)
            k, v = k[: len(ids)], v[: len(ids)]
            if self.host_sharding is not None:
                k, v = jax.device_put((k, v), self.host_sharding)  # asynchronous copies into pinned host memory
            else:
                for array in (*k, *v):
                    array.copy_to_host_async()
            blocks += zip(k, v)
        return blocks

    def scatter(self, kv_caches: KVCaches, block_ids: list[int], blocks: list[BlockData]) -> KVCaches:
        """``blocks`` (from host memory or numpy) written to ``block_ids``, each block copied to the device on its
        own."""
        for start, ids, bucket in self._chunks(block_ids):
            padded = np.full(bucket, self.num_blocks, np.int32)  # padding lands past the cache: dropped
            padded[: len(ids)] = ids
            chunk = blocks[start : start + len(ids)]
            k, v = jax.device_put(([b[0] for b in chunk], [b[1] for b in chunk]), self.block_sharding)
            k, v = tuple(k) + (k[0],) * (bucket - len(ids)), tuple(v) + (v[0],) * (bucket - len(ids))
            kv_caches = self.compilation.kv_scatter.get(bucket)(kv_caches, padded, k, v)
        return kv_caches
