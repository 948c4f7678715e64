"""Ragged paged attention as a Mosaic GPU (Pallas) kernel for NVIDIA Hopper.

:mod:`.schedule` cuts each request's query rows into tiles, :mod:`.kernel` is the
kernel body and its launch, :mod:`.tuning` the launch parameters and the table that
picks them, :mod:`.wrapper` the public entry that runs the three together.
"""

from jaxrunner.ops.attention_mgpu.kernel import launch_kernel
from jaxrunner.ops.attention_mgpu.schedule import (
    TileSchedule,
    num_granules_bound,
    num_tiles_bound,
    packed_queries,
    tile_schedule,
)
from jaxrunner.ops.attention_mgpu.tuning import (
    FP8_CACHE_DTYPES,
    FP8_PREFILL_COMPUTE_REGISTERS,
    QUERY_DTYPES,
    SHARED_MEMORY_BYTES,
    KernelConfig,
    choose_config,
    choose_splits,
    config_for,
    device_sms,
    kernel_supports,
    program_shared_memory,
)
from jaxrunner.ops.attention_mgpu.wrapper import compute_dtype, fp8_queries, prepare_tiles, ragged_paged_attention_mgpu

__all__ = [
    "FP8_CACHE_DTYPES",
    "FP8_PREFILL_COMPUTE_REGISTERS",
    "QUERY_DTYPES",
    "SHARED_MEMORY_BYTES",
    "KernelConfig",
    "TileSchedule",
    "choose_config",
    "choose_splits",
    "compute_dtype",
    "config_for",
    "device_sms",
    "fp8_queries",
    "kernel_supports",
    "launch_kernel",
    "num_granules_bound",
    "num_tiles_bound",
    "packed_queries",
    "prepare_tiles",
    "program_shared_memory",
    "ragged_paged_attention_mgpu",
    "tile_schedule",
]
