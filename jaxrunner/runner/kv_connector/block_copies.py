"""The two programs a connector moves blocks with: a gather of blocks out of the device cache, a scatter into it.

Both take a bucket of block ids (``CompilationManager.kv_block_buckets``, powers of two), so no
step compiles whatever number of blocks it moves. Blocks go in and out one array
each (a block's K or V over all layers), so that each can be copied to or from
host memory on its own, with no staging buffer to lay them out on the host. A
gather's padding reads the null block and is dropped on the host; a scatter's
padding ids lie past the cache and are dropped by the scatter.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from jaxrunner.runner.kv_cache import KVCaches

Block = Shaped[Array, "num_layers block_size num_kv_heads head_dim"]


def gather_blocks(
    kv_caches: KVCaches, block_ids: Int[Array, " num_moved"]
) -> tuple[tuple[Block, ...], tuple[Block, ...]]:
    """The K and V of each of ``block_ids`` over all layers."""
    k = jnp.stack([k_cache[block_ids] for k_cache, _ in kv_caches], axis=1)
    v = jnp.stack([v_cache[block_ids] for _, v_cache in kv_caches], axis=1)
    return tuple(k), tuple(v)


def scatter_blocks(
    kv_caches: KVCaches, block_ids: Int[Array, " num_moved"], k: tuple[Block, ...], v: tuple[Block, ...]
) -> KVCaches:
    """The caches with ``block_ids`` overwritten by ``k`` and ``v``, a block each (ids past the cache: dropped)."""
    k_all, v_all = jnp.stack(k, axis=1), jnp.stack(v, axis=1)  # [num_layers, num_moved, ...]
    return [
        (k_cache.at[block_ids].set(k_all[i], mode="drop"), v_cache.at[block_ids].set(v_all[i], mode="drop"))
        for i, (k_cache, v_cache) in enumerate(kv_caches)
    ]
