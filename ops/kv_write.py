"""Write the current step's keys and values into the paged KV cache: XLA's scatter or the Mosaic GPU kernel."""

import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxrunner.compat import mosaic_gpu_interpreter
from jaxrunner.ops.attention_backend import AttentionBackend
from jaxrunner.ops.kv_write_mgpu import Cache, NewKV, write_kv_mgpu


def _scatter_slots(cache: Cache, new: NewKV, slot_mapping: Int[Array, " num_tokens"]) -> Cache:
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
    slot_mapping: Int[Array, " num_tokens"],
    *,
    impl: str = "reference",
    interpret: bool | None = None,
) -> tuple[Cache, Cache]:
    """Write one layer's new K/V rows into its caches and return the updated caches.

    Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; padded
    tokens (slot -1) are never written. New values are cast to the cache dtype.
    Under ``jit`` with the caches donated, either implementation updates them in
    place. ``impl`` "reference" is XLA's scatter; "mosaic_gpu" the kernel of
    :mod:`jaxrunner.ops.kv_write_mgpu`, through its interpreter if ``interpret``
    (None: if JAX's default devices are no GPU). A runner's ``AttentionBackend``
    picks both (``kv_write_impl``, ``interpret``).
    """
    if impl == "mosaic_gpu":
        if interpret is None:
            interpret = AttentionBackend.default().interpret
        interpreter = mosaic_gpu_interpreter() if interpret else None
        return write_kv_mgpu(k_cache, v_cache, k_new, v_new, slot_mapping, interpret=interpreter)
    if impl != "reference":
        raise ValueError(f"unknown KV write impl {impl!r}; valid: 'reference', 'mosaic_gpu'")
    return (
        _scatter_slots(k_cache, k_new, slot_mapping),
        _scatter_slots(v_cache, v_new, slot_mapping),
    )
