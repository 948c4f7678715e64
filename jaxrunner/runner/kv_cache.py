"""The paged KV cache: its shape, how many blocks fit, and its allocation."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.compat import device_memory_stats
from jaxrunner.config import CacheConfig

logger = logging.getLogger(__name__)

KVCaches = list[tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Per layer, K and V arrays of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: jnp.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's K and V over all layers."""
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * jnp.dtype(self.dtype).itemsize

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) cache shape for ``num_blocks`` blocks."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def per_device(self, tensor_parallel_size: int) -> KVCacheSpec:
        """What one device holds of every block when the KV heads are split over ``tensor_parallel_size``."""
        return dataclasses.replace(self, num_kv_heads=self.num_kv_heads // tensor_parallel_size)

    def abstract(
        self, num_blocks: int, sharding: jax.sharding.Sharding | None = None
    ) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """Shape-only stand-ins, for ahead-of-time compilation."""
        s = jax.ShapeDtypeStruct(self.block_shape(num_blocks), self.dtype, sharding=sharding)
        return [(s, s) for _ in range(self.num_layers)]


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, sharding: jax.sharding.Sharding) -> KVCaches:
    """Zeroed caches, each device allocating only its own shard."""
    shape = spec.block_shape(num_blocks)
    zeros = lambda: jnp.zeros(shape, spec.dtype, device=sharding)
    return [(zeros(), zeros()) for _ in range(spec.num_layers)]


def determine_num_blocks(
    spec: KVCacheSpec,
    cache_config: CacheConfig,
    # jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
    device: jax.Device,  # pyright: ignore[reportInvalidTypeForm]
    activation_bytes: int,
    max_useful_blocks: int,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks that fit in what weights and the profiled activations leave on ``device``.

    ``spec`` is what one device holds of each block (``KVCacheSpec.per_device``);
    the devices of a mesh are alike, so one device's budget sizes them all.
    On a GPU: ``bytes_limit * gpu_memory_utilization - bytes_in_use - activations``.
    Where the backend keeps no statistics (the CPU), the cache gets
    ``cpu_kv_cache_bytes``, capped at what the runner can ever address.
    ``extra_bytes_per_block`` is a second cache on the same block ids (a draft model's).
    """
    bytes_per_block = spec.bytes_per_block + extra_bytes_per_block
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    stats = device_memory_stats(device)
    if stats is None:
        budget = cache_config.cpu_kv_cache_bytes
        num_blocks = min(budget // bytes_per_block, max_useful_blocks)
    else:
        limit = stats["bytes_limit"] * cache_config.gpu_memory_utilization
        budget = int(limit - stats["bytes_in_use"] - activation_bytes)
        num_blocks = budget // bytes_per_block
        logger.info(
            "KV cache: %.2f GiB limit, %.2f GiB in use, %.2f GiB activations -> %d blocks",
            limit / 2**30,
            stats["bytes_in_use"] / 2**30,
            activation_bytes / 2**30,
            num_blocks,
        )
    if num_blocks < 2:
        raise ValueError(
            f"Only {max(num_blocks, 0)} KV cache blocks fit ({bytes_per_block} bytes each, "
            f"budget {max(budget, 0)} bytes). Raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or use a smaller model."
        )
    return int(num_blocks)


def kv_cache_capacity(spec: KVCacheSpec, num_blocks: int) -> dict[str, float]:
    """What the cache holds: blocks, tokens and GiB."""
    return {
        "num_blocks": num_blocks,
        "num_tokens": num_blocks * spec.block_size,
        "gib": float(np.float64(num_blocks) * spec.bytes_per_block / 2**30),
    }
