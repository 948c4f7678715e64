"""Write the current step's keys and values into the paged KV cache: XLA's scatter or the Mosaic GPU kernel."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxrunner.compat import is_hopper, mosaic_gpu_interpreter_off_gpu
from jaxrunner.ops.kv_write_mgpu import Cache, NewKV, kernel_supports, write_kv_mgpu

KERNEL_MIN_TOKENS = 1024
"""Fewest tokens for which the automatic choice takes the kernel: it wins clearly only at prefill-sized
writes, and below them neither implementation is reliably ahead (``benchmarks/decisions/kv_write_threshold.md``)."""


def pick_kv_write_impl(num_tokens: int, k_cache: Cache, forced: str | None) -> str:
    """``forced`` if given, else the kernel on Hopper for writes of at least ``KERNEL_MIN_TOKENS`` tokens
    whose rows it can copy, else XLA's scatter ("reference")."""
    if forced:
        return forced
    large = num_tokens >= KERNEL_MIN_TOKENS
    return "mosaic_gpu" if large and kernel_supports(k_cache) and is_hopper(jax.devices()[0]) else "reference"


def _scatter_slots(cache: Cache, new: NewKV, slot_mapping: Int[Array, "num_tokens"]) -> Cache:
    """Store ``new[t]`` at slot ``slot_mapping[t]`` of ``cache``; slot -1 is dropped.

    The cache is viewed as ``[num_blocks * block_size, ...]`` (a free reshape), so a
    slot is a row index; negative slots are sent past the end, where ``mode="drop"``
    discards them (a plain -1 would wrap around to the last slot).
    """
    num_blocks, block_size = cache.shape[:2]
    num_slots = num_blocks * block_size
    flat = cache.reshape(num_slots, *cache.shape[2:])
    rows = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = flat.at[rows].set(new.astype(cache.dtype), mode="drop")
    return flat.reshape(cache.shape)


def write_kv(
    k_cache: Cache,
    v_cache: Cache,
    k_new: NewKV,
    v_new: NewKV,
    slot_mapping: Int[Array, "num_tokens"],
    *,
    impl: str = "reference",
) -> tuple[Cache, Cache]:
    """Write one layer's new K/V rows into its caches and return the updated caches.

    Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; padded
    tokens (slot -1) are never written. New values are cast to the cache dtype.
    Under ``jit`` with the caches donated, either implementation updates them in
    place. ``impl`` "reference" is XLA's scatter; "mosaic_gpu" the kernel of
    :mod:`jaxrunner.ops.kv_write_mgpu` (through its interpreter off a GPU).
    """
    if impl == "mosaic_gpu":
        return write_kv_mgpu(k_cache, v_cache, k_new, v_new, slot_mapping, interpret=mosaic_gpu_interpreter_off_gpu())
    if impl != "reference":
        raise ValueError(f"unknown KV write impl {impl!r}; valid: 'reference', 'mosaic_gpu'")
    return (
        _scatter_slots(k_cache, k_new, slot_mapping),
        _scatter_slots(v_cache, v_new, slot_mapping),
    )
