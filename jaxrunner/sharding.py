"""Tensor and data parallelism on ``jax.sharding``: the device mesh and the logical-axis rules.

The mesh has two named axes. ``model`` holds the ``tensor_parallel_size``
devices that share one copy of the model, Megatron-style: q/k/v and gate/up
are split by output features (column parallel), o_proj and down_proj by input
features (row parallel), the embedding and lm_head by vocabulary, and norms are
replicated. ``data`` holds ``data_parallel_size`` such groups, one independent
engine replica per row.

Every parameter names its logical axes (``jaxrunner.models.partitioning``) and
``ShardingRules`` maps logical axes to mesh axes, so a layout is one table to
read. XLA's SPMD partitioner inserts the collectives the shardings imply; the
KV write and attention run per KV-head shard under ``shard_map``
(``models/sharded_attention.py``).

The mesh is built from ``jax.devices()``, every process's devices: after
``jax.distributed.initialize`` (``jaxrunner/launch.py``) the same code lays
the mesh over several hosts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrunner.config import ParallelConfig

DATA_AXIS = "data"
MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The mesh axis that splits each logical axis; None replicates it."""

    vocab: str | None = MODEL_AXIS  # embedding rows, lm_head columns (padded to a multiple of the TP size)
    q_heads: str | None = MODEL_AXIS  # o_proj inputs
    kv_heads: str | None = MODEL_AXIS  # qkv_proj outputs (a KV head with its query heads), the KV cache's heads
    mlp: str | None = MODEL_AXIS  # gate_up_proj outputs, down_proj inputs (every expert's too)
    expert: str | None = None  # mixture-of-experts: every device holds a slice of every expert
    embed: str | None = None  # the residual stream's features
    head_dim: str | None = None

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """The ``PartitionSpec`` of an array with these logical axes."""
        return PartitionSpec(*(None if axis is None else getattr(self, axis) for axis in logical_axes))


RULES = ShardingRules()

KV_CACHE_LOGICAL_AXES = (None, None, "kv_heads", "head_dim")
"""``[num_blocks, block_size, num_kv_heads, head_dim]``: each device holds its KV heads of every block."""


def make_mesh(
    parallel: ParallelConfig,
    # jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
    devices: Sequence[jax.Device] | None = None,  # pyright: ignore[reportInvalidTypeForm]
) -> Mesh:
    """The ``(data, model)`` mesh: ``data_parallel_size`` rows of ``tensor_parallel_size`` devices.

    Takes the first devices of ``jax.devices()`` (every host's, after
    ``jax.distributed.initialize``). Both axes are automatic: XLA propagates
    shardings from the parameters and caches.
    """
    devices = list(jax.devices() if devices is None else devices)
    tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
    if parallel.world_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {parallel.world_size} devices, "
            f"but only {len(devices)} are present ({devices[0].platform}). Lower one of them; on a CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts simulates N devices."
        )
    grid = np.array(devices[: parallel.world_size], dtype=object).reshape(dp, tp)
    _check_replicas_span_processes(grid)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def _check_replicas_span_processes(grid: np.ndarray) -> None:
    """On several hosts every process steps every replica, so each replica needs devices on every host."""
    processes = set(range(jax.process_count()))
    for i, row in enumerate(grid):
        held = {d.process_index for d in row}
        if held != processes:
            raise ValueError(
                f"Data-parallel replica {i} lies on hosts {sorted(held)} of {sorted(processes)}; with several "
                "hosts every process steps every replica, so each must span all hosts. Use "
                "data_parallel_size=1 across hosts, or run one independent jaxrunner per host."
            )


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, tensor_parallel_size)`` mesh per data-parallel replica: the rows of ``mesh``."""
    return [
        Mesh(mesh.devices[i : i + 1], mesh.axis_names, axis_types=mesh.axis_types) for i in range(mesh.shape[DATA_AXIS])
    ]


def tensor_parallel_size(mesh: Mesh | None) -> int:
    """Devices on the ``model`` axis; 1 without a mesh."""
    return 1 if mesh is None else mesh.shape[MODEL_AXIS]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp``, so that every device holds an equal slice."""
    return -(-vocab_size // tp) * tp


def kv_cache_sharding(mesh: Mesh, rules: ShardingRules = RULES) -> NamedSharding:
    """Every layer's K and V cache on ``mesh``: split on KV heads."""
    return NamedSharding(mesh, rules.spec(KV_CACHE_LOGICAL_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device of ``mesh``: device state, step inputs, logits and sampled tokens."""
    return NamedSharding(mesh, PartitionSpec())


def min_over_processes(value: int) -> int:
    """The smallest ``value`` of all processes (one process: ``value``): a size every host can hold."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


def host_copy(array: jax.Array) -> np.ndarray:
    """A replicated array's value, read from this process's own copy (so several hosts work alike).

    numpy reads a replicated array from one local shard already, the one whose copy
    ``copy_to_host_async`` started; a sharded array would need a gather, so it is refused.
    """
    if not array.is_fully_replicated:
        raise ValueError(f"host_copy reads replicated arrays; this one is sharded as {array.sharding}.")
    return np.asarray(array)
