"""The kernel behind :func:`jaxrunner.ops.ragged_paged_attention`'s contract: schedule, launch, combine.

Same contract as :func:`ragged_paged_attention_reference`, the oracle it is tested
against; one call serves decodes, chunked and full prefills packed in one batch.
The XLA ops around the kernel build the tile schedule and the packed queries,
and afterwards gather the packed output rows back into token order, combining
the KV splits' partial outputs by their log-sum-exps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.attention_mgpu.kernel import launch_kernel
from jaxrunner.ops.attention_mgpu.schedule import (
    TileSchedule,
    num_granules_bound,
    num_tiles_bound,
    output_row_index,
    packed_queries,
    tile_schedule,
)
from jaxrunner.ops.attention_mgpu.tuning import SCALE_LANES, KernelConfig, config_for
from jaxrunner.ops.fp8_matmul import FP8_MAX


def compute_dtype(q_dtype, cache_dtype) -> jnp.dtype:
    """The kernel's queries and matmuls: q's dtype over a cache of q's dtype; over an FP8 cache float16,
    which holds every FP8 value exactly and is what Hopper's FP8 conversion (``cvt.rn.f16x2.e4m3x2``) gives."""
    return jnp.dtype(jnp.float16) if jnp.dtype(cache_dtype).itemsize == 1 else jnp.dtype(q_dtype)


def fp8_queries(q: Float[Array, "*rows head_dim"]) -> tuple[Float[Array, "*rows head_dim"], Float[Array, " *rows"]]:
    """Each row of ``q`` in e4m3 and its scale, the power of two that brings the row's largest magnitude
    into ``(FP8_MAX / 2, FP8_MAX]`` (``config.fp8_scores``): nothing saturates, and the row's
    values times its scale are exact in 16 bits. An all-zero row (padding) stays zero."""
    rows = q.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(rows), axis=-1), 2.0**-100)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / FP8_MAX)))
    return (rows / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def prepare_tiles(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    num_kv_heads: int,
    metadata: AttentionMetadata,
    config: KernelConfig,
    sliding_window: int | None,
) -> tuple[TileSchedule, Float[Array, "num_kv_heads packed_rows head_dim"]]:
    """The kernel's inputs besides the caches: the tile schedule and the packed queries."""
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    num_reqs = metadata.block_tables.shape[0]
    num_tiles = num_tiles_bound(num_tokens, num_reqs, group, config.tile_rows)
    schedule = tile_schedule(metadata, group, config.tile_rows, num_tiles, sliding_window)
    num_granules = num_granules_bound(num_tokens, num_reqs, group, config.tile_rows)
    return schedule, packed_queries(q, schedule, num_kv_heads, num_granules)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "config", "interpret"))
def ragged_paged_attention_mgpu(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    v_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    config: KernelConfig | None = None,
    interpret=None,
) -> Float[Array, "num_tokens num_q_heads head_dim"]:
    """The Mosaic GPU kernel behind :func:`ragged_paged_attention`'s contract.

    The caches are q's dtype or FP8 (read unscaled: the caller applies their scales); over an e4m3 cache
    with ``config.fp8_scores`` the queries are rounded to e4m3 a row (``fp8_queries``) for ``Q K^T``.
    ``config`` overrides the tuning table; ``interpret`` (an ``InterpretGPUParams``)
    runs the kernel through the Mosaic GPU interpreter on the CPU. Jitted, so that a
    model calling it once per layer lowers (and compiles) the kernel once per shape.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out_dtype = q.dtype
    if config is None:
        config = config_for(q, k_cache, metadata)
    dtype = compute_dtype(q.dtype, k_cache.dtype)
    schedule, q_packed = prepare_tiles(q.astype(dtype), num_kv_heads, metadata, config, sliding_window)
    q_scales = None
    if config.fp8_scores and k_cache.dtype == jnp.float8_e4m3fn:
        q_packed, scales = fp8_queries(q_packed)
        q_scales = jnp.broadcast_to(scales[..., None], (*scales.shape, SCALE_LANES))
    results = launch_kernel(
        schedule.fields,
        metadata.block_tables.astype(jnp.int32),
        q_packed,
        k_cache,
        v_cache,
        config=config,
        group=group,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        q_scales=q_scales,
        out_dtype=dtype,
        interpret=interpret,
    )
    # One gather of whole rows from each split's packed output into [num_tokens, num_kv_heads, group, ...].
    rows = output_row_index(metadata, schedule, num_tokens, group, config.tile_rows, results[0].shape[1:3])
    splits = config.num_kv_splits
    gather = lambda x: jnp.take(x.reshape(splits, -1, *x.shape[3:]), rows, axis=1, mode="fill", fill_value=0)
    out = gather(results[0])
    if splits > 1:  # padding rows: outputs 0 and log-sum-exps 0 in every split, so they combine to 0
        lse = gather(results[1])
        weight = jnp.exp2(lse - lse.max(axis=0, keepdims=True))
        out = (out * weight[..., None]).sum(axis=0) / weight.sum(axis=0)[..., None]
    else:
        out = out[0]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(out_dtype)
