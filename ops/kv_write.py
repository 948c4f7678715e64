"""Write the current step's keys and values into the paged KV cache: XLA's scatter or the Mosaic GPU kernel.

New rows are brought to the cache's dtype here, in XLA, before either
implementation runs: an FP8 cache stores ``value / scale`` saturated to the
format's range, so both implementations copy rows that are already FP8.
"""

import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from jaxrunner.compat import mosaic_gpu_interpreter
from jaxrunner.ops.attention_backend import AttentionBackend
from jaxrunner.ops.kv_write_mgpu import Cache, NewKV, write_kv_mgpu


def is_fp8(dtype: DTypeLike) -> bool:
    """Whether ``dtype`` is an 8-bit float (vLLM's "fp8_e4m3" float8_e4m3fn, "fp8_e5m2" float8_e5m2)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def quantize_kv(new: NewKV, dtype: DTypeLike, scale: Float[Array, ""] | None = None) -> NewKV:
    """New K (or V) rows as the cache's ``dtype`` stores them: ``new / scale`` (in float32; no scale: 1).

    For an FP8 cache the quotient is clipped to the format's largest finite value
    (448 for e4m3fn, 57344 for e5m2) before the cast, so an outlier saturates
    rather than turning into NaN (e4m3fn has no inf) or inf.
    """
    if scale is None and not is_fp8(dtype):
        return new.astype(dtype)
    x = new.astype(jnp.float32)
    if scale is not None:
        x = x / scale
    if is_fp8(dtype):
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


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
    flat = flat.at[rows].set(new, mode="drop")
    return flat.reshape(cache.shape)


def write_kv(
    k_cache: Cache,
    v_cache: Cache,
    k_new: NewKV,
    v_new: NewKV,
    slot_mapping: Int[Array, " num_tokens"],
    *,
    k_scale: Float[Array, ""] | None = None,
    v_scale: Float[Array, ""] | None = None,
    impl: str = "reference",
    interpret: bool | None = None,
) -> tuple[Cache, Cache]:
    """Write one layer's new K/V rows into its caches and return the updated caches.

    Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; padded
    tokens (slot -1) are never written. New values are stored as
    :func:`quantize_kv` makes them: divided by ``k_scale`` (``v_scale``) where
    given, saturated for an FP8 cache, cast to the cache dtype. Under ``jit``
    with the caches donated, either implementation updates them in place.
    ``impl`` "reference" is XLA's scatter; "mosaic_gpu" the kernel of
    :mod:`jaxrunner.ops.kv_write_mgpu`, through its interpreter if ``interpret``
    (None: if JAX's default devices are no GPU). A runner's ``AttentionBackend``
    picks both (``kv_write_impl``, ``interpret``).
    """
    k_new, v_new = quantize_kv(k_new, k_cache.dtype, k_scale), quantize_kv(v_new, v_cache.dtype, v_scale)
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
