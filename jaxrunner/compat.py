"""The one place that knows about differences between JAX versions and backends (and names JAX's private modules)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from jaxrunner import envs


# jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
def device_memory_stats(device: jax.Device) -> dict[str, int] | None:  # pyright: ignore[reportInvalidTypeForm]
    """The allocator's statistics, or None on backends that keep none (the CPU)."""
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats


def device_total_bytes(stats: dict[str, int]) -> int:
    """The device's total memory, from its allocator's statistics (``device_memory_stats``).

    JAX has no reading of a GPU's total memory. XLA's GPU allocators (BFC, JAX's default,
    and VMM) are limited to CUDA's total device memory times the pool fraction JAX started
    them with, and report that limit as ``bytes_limit``.
    """
    return round(stats["bytes_limit"] / envs.gpu_memory_pool_fraction())


def mosaic_gpu_interpreter():
    """Parameters that run a Mosaic GPU kernel through its CPU interpreter.

    The interpreter lives in a private JAX module; this is the one place that names it.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


@contextlib.contextmanager
def mosaic_gpu_interpreter_on_several_devices() -> Iterator[None]:
    """Kernels traced inside run through the Mosaic GPU interpreter on several devices at once (shard_map).

    The interpreter's end-of-kernel check that no barrier is left allocated reads
    every device's allocations, so on jax 0.10.2 it fails while another device's
    kernel is still running, and that device then waits forever at the clean-up
    barrier. Traced inside this context, kernels skip that check; single-device
    interpretation keeps it.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    check = gpu_callbacks._assert_no_barriers_allocated
    gpu_callbacks._assert_no_barriers_allocated = lambda token: token
    try:
        yield
    finally:
        gpu_callbacks._assert_no_barriers_allocated = check


# jax.Device: see device_memory_stats.
def is_hopper(device: jax.Device) -> bool:  # pyright: ignore[reportInvalidTypeForm]
    """Whether ``device`` is an NVIDIA GPU of compute capability 9.x (H100, H200)."""
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")
