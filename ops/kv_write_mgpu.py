"""The KV cache write as a Mosaic GPU (Pallas) kernel for NVIDIA Hopper.

Same contract as :func:`jaxrunner.ops.kv_write.write_kv`'s XLA scatter, its test
oracle. One program per token: it reads the token's slot from GMEM and, unless
the slot is -1 (padding), copies the token's K and V rows (``[num_kv_heads,
head_dim]`` each) by TMA into shared memory and from there to offset
``slot % block_size`` of block ``slot // block_size`` of each cache. The caches
are passed as mutable refs in GMEM, which the kernel aliases in and out, so it
writes them in place: under ``jit`` with the caches donated, no cache-sized
buffer is allocated or copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

Cache = Float[Array, "num_blocks block_size num_kv_heads head_dim"]
NewKV = Float[Array, "num_tokens num_kv_heads head_dim"]

ROW_BYTES_MULTIPLE = 128
"""A warpgroup's copies move a multiple of 128 bytes: a token's row (kv heads x head dim) must be one."""


def kernel_supports(cache: Cache) -> bool:
    """Whether the kernel can copy this cache's token rows: a multiple of ``ROW_BYTES_MULTIPLE`` bytes."""
    return _row_bytes(cache) % ROW_BYTES_MULTIPLE == 0


def _row_bytes(cache: Cache) -> int:
    num_kv_heads, head_dim = cache.shape[2:]
    return num_kv_heads * head_dim * cache.dtype.itemsize


def _write_token(slot_ref, k_new_ref, v_new_ref, k_cache_ref, v_cache_ref, *, block_size):
    """One program: token ``t``'s K and V rows into their slot, through shared memory."""
    t = jax.lax.axis_index("token")
    slot = slot_ref[t]

    def scoped(k_smem, v_smem, loaded):
        block, offset = slot // block_size, slot % block_size
        plgpu.copy_gmem_to_smem(k_new_ref.at[t], k_smem, loaded.at[0])
        plgpu.copy_gmem_to_smem(v_new_ref.at[t], v_smem, loaded.at[1])
        plgpu.barrier_wait(loaded.at[0])
        plgpu.copy_smem_to_gmem(k_smem, k_cache_ref.at[block, offset])
        plgpu.barrier_wait(loaded.at[1])
        plgpu.copy_smem_to_gmem(v_smem, v_cache_ref.at[block, offset])
        plgpu.wait_smem_to_gmem(0)

    row = k_new_ref.shape[1:]
    pl.when(slot >= 0)(
        lambda: pl.run_scoped(
            scoped, plgpu.SMEM(row, k_new_ref.dtype), plgpu.SMEM(row, k_new_ref.dtype), plgpu.Barrier(num_barriers=2)
        )
    )


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv_mgpu(
    k_cache: Cache,
    v_cache: Cache,
    k_new: NewKV,
    v_new: NewKV,
    slot_mapping: Int[Array, " num_tokens"],
    *,
    interpret=None,
) -> tuple[Cache, Cache]:
    """Write one layer's new K/V rows at ``slot_mapping`` (slot -1 skipped) and return the caches.

    New values are cast to the cache dtype first, plainly: :func:`jaxrunner.ops.kv_write.write_kv`
    scales and saturates the rows of an FP8 cache before it calls this. ``interpret`` (an
    ``InterpretGPUParams``) runs the kernel through the Mosaic GPU interpreter on
    the CPU. A token's row must be a multiple of 128 bytes (every model the
    attention kernel takes has such rows); others get a ValueError.
    """
    num_tokens, num_kv_heads, head_dim = k_new.shape
    if not kernel_supports(k_cache):
        raise ValueError(
            f"The KV write kernel copies rows of a multiple of {ROW_BYTES_MULTIPLE} bytes; this cache's rows "
            f"({num_kv_heads} kv heads x {head_dim} x {k_cache.dtype.itemsize} bytes) are {_row_bytes(k_cache)}. "
            "Use impl='reference' (XLA's scatter)."
        )
    k_ref = jax.new_ref(k_cache, memory_space=plgpu.GMEM)
    v_ref = jax.new_ref(v_cache, memory_space=plgpu.GMEM)
    # pl.kernel, not plgpu.kernel: the latter's batching wrapper takes no refs. pl.kernel has no return
    # annotation, and pyright infers its decorator mode's one-argument lambda among the returns: hence the ignore.
    pl.kernel(
        functools.partial(_write_token, block_size=k_cache.shape[1]),
        out_type=(),
        mesh=plgpu.Mesh(grid=(num_tokens,), grid_names=("token",)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(slot_mapping.astype(jnp.int32), k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype), k_ref, v_ref)  # pyright: ignore[reportCallIssue]
    return jax.freeze(k_ref), jax.freeze(v_ref)
