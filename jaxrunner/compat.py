"""The one place that knows about differences between JAX versions and backends."""

from __future__ import annotations

import jax


def enable_persistent_compilation_cache(cache_dir: str) -> None:
    """Turn on JAX's persistent compilation cache for every program, however small.

    JAX skips programs that compile in under a second by default, which would
    leave the small sampling programs uncached.
    """
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def device_memory_stats(device: jax.Device) -> dict[str, int] | None:
    """The allocator's statistics, or None on backends that keep none (the CPU)."""
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats


def mosaic_gpu_interpreter():
    """Parameters that run a Mosaic GPU kernel through its CPU interpreter.

    The interpreter lives in a private JAX module; this is the one place that names it.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def is_hopper(device: jax.Device) -> bool:
    """Whether ``device`` is an NVIDIA GPU of compute capability 9.x (H100, H200)."""
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")
