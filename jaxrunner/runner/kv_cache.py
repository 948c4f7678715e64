"""The paged KV cache: its shape, how many blocks fit, and its allocation."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxrunner import envs
from jaxrunner.compat import device_memory_stats, device_total_bytes
from jaxrunner.config import CacheConfig, RunnerConfig
from jaxrunner.models.kv_cache_groups import KVCacheGroups
from jaxrunner.runner.unsupported import refuse_combinations

logger = logging.getLogger(__name__)

KVCaches = list[tuple[jax.Array, jax.Array]]


def check_kv_cache_groups_support(config: RunnerConfig, groups: KVCacheGroups) -> None:
    """NotImplementedError naming what several KV-cache groups (a model mixing sliding and full attention)
    cannot be served with yet."""
    if groups.num_groups == 1:
        return
    unsupported = [
        ("speculative decoding", config.speculative_config is not None),
        ("a KV connector (kv_transfer_config)", config.kv_transfer_config is not None),
    ]
    subject = f"A model of sliding-window and full-attention layers, in {groups.num_groups} KV-cache groups,"
    refuse_combinations(subject, unsupported, "serve it without.")


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Per cache tensor, K and V arrays of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``: one
    tensor a layer, or with KV-cache groups one a place in a group (``models/kv_cache_groups.py``);
    ``num_layers`` counts the tensors."""

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


# Bytes of each device the KV cache leaves free beyond the weights and the profiled peak. The profile
# run sees the largest forward and sampling programs; not what a real step adds around them (its
# inputs in transfer, the sampled tokens of the step before still on their way to the host), the
# programs compiled after sizing (rounds of several decode steps, prompt logprobs), whose temporaries
# may exceed the profiled ones, nor the allocator's fragmentation.
KV_CACHE_MARGIN_BYTES = 1 << 30


def _gib(size: int) -> str:
    """Bytes as GiB, for logs and errors."""
    return f"{size / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """How one device's memory was shared out when the KV cache was sized (a mesh's devices alike).

    vLLM's rule: an engine may use ``gpu_memory_utilization`` of the device's total memory;
    the KV cache gets that, less what is in use once the model is loaded (``weights_bytes``:
    the weights and the request state), less the peak the largest steps add while they run
    (``activation_bytes``, from the profile run), less ``margin_bytes``. Where the backend
    keeps no memory statistics (the CPU) the device's figures are None and the cache got
    ``CacheConfig.cpu_kv_cache_bytes``; ``num_gpu_blocks_override`` leaves them all None.
    ``bytes_per_block`` is this device's share of a block, a draft model's cache included.
    With several KV-cache groups every token takes a block's slot in each, so the cache holds
    ``num_tokens`` (vLLM's "KV cache size" in tokens), not every block's slots.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    gpu_memory_utilization: float
    total_bytes: int | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    margin_bytes: int | None = None
    num_kv_cache_groups: int = 1

    @property
    def num_tokens(self) -> int:
        """The tokens the blocks hold, each group's share of them (vLLM's figure)."""
        return self.num_blocks // self.num_kv_cache_groups * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """What the blocks take on this device."""
        return self.num_blocks * self.bytes_per_block

    def __str__(self) -> str:
        cache = (
            f"KV cache {self.num_blocks} blocks allocated, {self.num_tokens} tokens, "
            f"{_gib(self.kv_cache_bytes)} a device"
        )
        total, weights, activations, margin = (
            self.total_bytes,
            self.weights_bytes,
            self.activation_bytes,
            self.margin_bytes,
        )
        if total is None or weights is None or activations is None or margin is None:
            return cache
        return (
            f"{self.gpu_memory_utilization} of {_gib(total)} a device: weights {_gib(weights)}, "
            f"activation peak {_gib(activations)}, margin {_gib(margin)}; {cache}"
        )

    def summary(self) -> dict[str, float | int | None]:
        """Sizes in GiB and the cache's blocks and tokens, for benchmark results."""
        gib = lambda size: None if size is None else size / 2**30
        return {
            "total_gib": gib(self.total_bytes),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights_gib": gib(self.weights_bytes),
            "activation_peak_gib": gib(self.activation_bytes),
            "margin_gib": gib(self.margin_bytes),
            "kv_cache_blocks": self.num_blocks,
            "kv_cache_tokens": self.num_tokens,
            "kv_cache_gib": gib(self.kv_cache_bytes),
        }


def size_kv_cache(
    block_size: int,
    bytes_per_block: int,
    cache_config: CacheConfig,
    # jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
    device: jax.Device,  # pyright: ignore[reportInvalidTypeForm]
    activation_bytes: int,
    max_useful_blocks: int,
) -> MemoryBudget:
    """The blocks that fit on ``device`` by vLLM's rule (``MemoryBudget``), with the figures they came from.

    ``bytes_per_block`` is what one device holds of each block (``KVCacheSpec.per_device``),
    a second cache on the same block ids (a draft model's) included; the devices of a
    mesh are alike, so one device's budget sizes them all. Where the backend keeps no
    statistics (the CPU), the cache gets ``cpu_kv_cache_bytes``, capped at what the
    runner can ever address.
    """
    utilization = cache_config.gpu_memory_utilization
    stats = device_memory_stats(device)
    if stats is None:
        num_blocks = min(cache_config.cpu_kv_cache_bytes // bytes_per_block, max_useful_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"Only {num_blocks} KV cache blocks of {bytes_per_block} bytes fit in "
                f"CacheConfig.cpu_kv_cache_bytes ({cache_config.cpu_kv_cache_bytes}); raise it."
            )
        return MemoryBudget(num_blocks, block_size, bytes_per_block, utilization, activation_bytes=activation_bytes)
    total, pool, fraction = device_total_bytes(stats), stats["bytes_limit"], envs.gpu_memory_pool_fraction()
    usable = int(total * utilization)
    if usable > pool:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {_gib(usable)}, more than JAX's memory pool holds: "
            f"{_gib(pool)}, {fraction} of the device's {_gib(total)}. Lower gpu_memory_utilization to {fraction}, "
            f"or set {envs.MEM_FRACTION_ENV_VARS[0]}={utilization} (or more) before JAX starts; unset, "
            f"jaxrunner sets it to {envs.GPU_MEMORY_POOL_FRACTION}."
        )
    weights = stats["bytes_in_use"]
    left = usable - weights - activation_bytes - KV_CACHE_MARGIN_BYTES
    num_blocks = max(left, 0) // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"Only {num_blocks} KV cache blocks fit: gpu_memory_utilization={utilization} of the device's "
            f"{_gib(total)}, less {_gib(weights)} in use after loading the model, {_gib(activation_bytes)} for the "
            f"largest steps' activations and a {_gib(KV_CACHE_MARGIN_BYTES)} margin, leaves {_gib(left)} for blocks "
            f"of {bytes_per_block} bytes. Raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "max_num_seqs (smaller steps need less for activations), or use a smaller model."
        )
    return MemoryBudget(
        num_blocks,
        block_size,
        bytes_per_block,
        utilization,
        total_bytes=total,
        weights_bytes=weights,
        activation_bytes=activation_bytes,
        margin_bytes=KV_CACHE_MARGIN_BYTES,
    )
