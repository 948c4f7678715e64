"""The two programs a connector moves blocks with: a gather of blocks out of the device cache, a scatter into it.

Both take a bucket of block ids (``CompilationManager.kv_block_buckets``, powers of two), so no
step compiles whatever number of blocks it moves. A gather's padding reads the
null block and is dropped on the host; a scatter's padding ids lie past the cache
and are dropped by the scatter.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from jaxrunner.runner.kv_cache import KVCaches

Blocks = Shaped[Array, "num_layers num_moved block_size num_kv_heads head_dim"]


def gather_blocks(kv_caches: KVCaches, block_ids: Int[Array, " num_moved"]) -> tuple[Blocks, Blocks]:
    """The K and V of ``block_ids`` over all layers."""
    k = jnp.stack([k_cache[block_ids] for k_cache, _ in kv_caches])
    v = jnp.stack([v_cache[block_ids] for _, v_cache in kv_caches])
    return k, v


def scatter_blocks(kv_caches: KVCaches, block_ids: Int[Array, " num_moved"], k: Blocks, v: Blocks) -> KVCaches:
    """The caches with ``block_ids`` overwritten by ``k`` and ``v`` (ids past the cache: dropped)."""
    return [
        (k_cache.at[block_ids].set(k[i], mode="drop"), v_cache.at[block_ids].set(v[i], mode="drop"))
        for i, (k_cache, v_cache) in enumerate(kv_caches)
    ]
