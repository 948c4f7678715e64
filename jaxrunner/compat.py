"""The one place that knows about differences between JAX versions and backends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax

ASYNC_DISPATCH_ENV_VAR = "PJRT_GPU_ENABLE_ASYNC_DISPATCH"
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"


def prefer_async_gpu_dispatch() -> None:
    """Have the PjRt GPU client launch each program from a thread of its own, unless the user chose.

    By default a call into a compiled program launches its kernels (then in a CUDA
    graph) on the calling thread: a decode step's forward call held the engine's Python
    thread for 7-11 ms (``benchmarks/step_overhead.py``), so the next step could
    not be prepared meanwhile. Read once, when JAX starts its GPU backend, so it
    must be set before the first computation; ``PJRT_GPU_ENABLE_ASYNC_DISPATCH=0``
    keeps the synchronous launch.
    """
    os.environ.setdefault(ASYNC_DISPATCH_ENV_VAR, "1")


def prefer_kernel_launches_to_cuda_graphs() -> None:
    """Have XLA launch a GPU program's kernels one by one rather than as CUDA graphs, unless the user chose.

    A decode step's forward is one CUDA graph of about 600 kernels. Its temporary
    and output buffers move from call to call, so before every launch XLA updates
    nearly every node of the graph (about 2 ms of host time), and the updated graph
    starts only once its previous launch has finished: the GPU sat idle 2-3 ms in
    every step (``benchmarks/decode_step.py --trace``). Launched one by one from
    PjRt's own thread, the kernels queue up while the previous step runs. XLA
    reads ``XLA_FLAGS`` once, when JAX starts its first backend, so this must
    come before JAX's first computation; a ``--xla_gpu_enable_command_buffer``
    of the user's in ``XLA_FLAGS`` is kept.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if not any(flag.split("=", 1)[0] == COMMAND_BUFFER_FLAG for flag in flags.split()):
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}=".strip()


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


def mosaic_gpu_interpreter_off_gpu():
    """None on a GPU (the kernel is compiled), else the interpreter's parameters: a kernel's ``interpret``."""
    return None if jax.devices()[0].platform == "gpu" else mosaic_gpu_interpreter()


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


def is_hopper(device: jax.Device) -> bool:
    """Whether ``device`` is an NVIDIA GPU of compute capability 9.x (H100, H200)."""
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")
