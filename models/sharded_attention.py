"""One layer's KV write and attention, run per KV-head shard under tensor parallelism.

With a mesh whose ``model`` axis has several devices, each device holds its
slice of the KV heads (and of the query heads that read them) and its slice of
every cache block. ``shard_map`` runs the write and the attention op (the
pure-JAX reference or the Mosaic GPU kernels) on each device's own heads, with
no communication: a query head's KV head always lives on its device. Without
such a mesh both run as they are.
"""

import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float

from jaxrunner.ops.attention import ragged_paged_attention
from jaxrunner.ops.attention_backend import AttentionBackend
from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.kv_write import Cache, write_kv
from jaxrunner.sharding import KV_CACHE_LOGICAL_AXES, RULES, tensor_parallel_size

_Q_SPEC = RULES.spec((None, "q_heads", "head_dim"))
_KV_SPEC = RULES.spec((None, "kv_heads", "head_dim"))
_CACHE_SPEC = RULES.spec(KV_CACHE_LOGICAL_AXES)


def write_and_attend(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k: Float[Array, "num_tokens num_kv_heads head_dim"],
    v: Float[Array, "num_tokens num_kv_heads head_dim"],
    kv_cache: tuple[Cache, Cache],
    metadata: AttentionMetadata,
    *,
    mesh: Mesh | None,
    backend: AttentionBackend | None = None,
    sm_scale: float,
    kv_scales: tuple[Float[Array, ""], Float[Array, ""]] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[Float[Array, "num_tokens num_q_heads head_dim"], tuple[Cache, Cache]]:
    """Write this step's K/V at ``metadata.slot_mapping``, then attend over the cache.

    ``backend`` picks both implementations (None: JAX's default devices' backend);
    ``kv_scales`` (``(k_scale, v_scale)``, None for an unscaled cache) go to both
    ops; the other options go to :func:`ragged_paged_attention`. Returns the attention
    output and the updated ``(k_cache, v_cache)``, sharded as they came in.
    """
    ops = backend or AttentionBackend.default()

    def local(q, k, v, k_cache, v_cache, metadata, kv_scales):  # on this device's shard of the heads
        k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
        k_cache, v_cache = write_kv(
            k_cache,
            v_cache,
            k,
            v,
            metadata.slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
            impl=ops.kv_write_impl(k.shape[0], k_cache),
            interpret=ops.interpret,
        )
        out = ragged_paged_attention(
            q,
            k_cache,
            v_cache,
            metadata,
            sm_scale=sm_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            impl=ops.attention_impl(q, k_cache),
            interpret=ops.interpret,
        )
        return out, k_cache, v_cache

    if tensor_parallel_size(mesh) > 1:
        # The kernel declares no varying mesh axes, so the replication check is off.
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(_Q_SPEC, _KV_SPEC, _KV_SPEC, _CACHE_SPEC, _CACHE_SPEC, PartitionSpec(), PartitionSpec()),
            out_specs=(_Q_SPEC, _CACHE_SPEC, _CACHE_SPEC),
            check_vma=False,
        )
    out, k_cache, v_cache = local(q, k, v, *kv_cache, metadata, kv_scales)
    return out, (k_cache, v_cache)
