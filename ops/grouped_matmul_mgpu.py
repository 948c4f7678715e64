"""The grouped matmul of mixture-of-experts layers as a Mosaic GPU (Pallas) kernel for NVIDIA Hopper.

Rows sorted by group (``ops/grouped_matmul.py``'s contract) are cut into tiles of
at most ``block_m`` rows of one group each (:func:`tile_schedule`, on the device);
one program per (tile, column block) streams its group's ``[K, block_n]`` slice of
``rhs`` through a ring of shared-memory stages by TMA and multiplies it on the
tensor cores (wgmma). Each tile's rows are gathered into a block of their own
first (a TMA copy of the tiled layout starts on a whole 8-row tile), and its
outputs come back from the same block. A group with no rows has no
tile, so its matrix is never read: at decode sizes the kernel reads the experts the
tokens were routed to, once each (XLA's ``ragged_dot`` on the GPU reads every
expert). Tiles past the last are empty programs that exit at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

GROUP, ROW_START, NUM_ROWS = 0, 1, 2
"""The columns of a tile in :func:`tile_schedule`'s fields."""


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tile sizes and pipeline depth of the kernel."""

    block_m: int = 64  # rows of one tile: the wgmma's M
    block_n: int = 128  # columns of rhs one program writes
    block_k: int = 64  # the contraction's stage: 128 bytes of bf16, one swizzle row
    num_stages: int = 4  # stages of the ring in flight


def num_tiles_bound(num_rows: int, num_groups: int, block_m: int) -> int:
    """Tiles any split of ``num_rows`` rows over ``num_groups`` groups needs: every non-empty group adds at
    most one partial tile to the ``num_rows / block_m`` whole ones."""
    return -(-num_rows // block_m) + min(num_groups, num_rows)


def tile_schedule(group_sizes: Int[Array, " num_groups"], num_rows: int, block_m: int) -> Int[Array, "num_tiles 3"]:
    """Each tile's ``(group, row_start, num_rows)``: a group's rows cut into tiles of ``block_m`` from its first
    row, groups in order; tiles past the last have no rows."""
    num_tiles = num_tiles_bound(num_rows, group_sizes.shape[0], block_m)
    sizes = group_sizes.astype(jnp.int32)
    row_offsets = jnp.cumsum(sizes) - sizes
    tiles_per_group = -(-sizes // block_m)
    tile_ends = jnp.cumsum(tiles_per_group)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, tile, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
    within = tile - (tile_ends[group] - tiles_per_group[group])
    rows = jnp.clip(sizes[group] - within * block_m, 0, block_m)
    rows = jnp.where(tile < tile_ends[-1], rows, 0)
    return jnp.stack([group, row_offsets[group] + within * block_m, rows], axis=1)


def _transforms(dtype, width: int) -> tuple:
    """Swizzled tiles of 8 rows, 128 bytes wide: the shared-memory layout wgmma and TMA want."""
    swizzle = min(128, width * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel_body(fields_ref, lhs_ref, rhs_ref, out_ref, *, config: GroupedMatmulConfig):
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    tile, column_block = lax.axis_index("tile"), lax.axis_index("column_block")
    group, num_rows = fields_ref[tile, GROUP], fields_ref[tile, NUM_ROWS]
    dtype = lhs_ref.dtype

    @pl.when(num_rows > 0)
    def _():
        def multiply(acc_ref):
            def stage(_, lhs_smem, rhs_smem):
                plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                stage,
                grid=(lhs_ref.shape[2] // bk,),
                in_specs=[
                    plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=_transforms(dtype, bk)),
                    plgpu.BlockSpec((bk, bn), lambda k: (k, column_block), transforms=_transforms(dtype, bn)),
                ],
                max_concurrent_steps=config.num_stages,
            )(lhs_ref.at[tile], rhs_ref.at[group])
            return acc_ref[...]

        acc = pl.run_scoped(multiply, plgpu.WGMMAAccumulatorRef((bm, bn), jnp.float32))

        def store(out_smem):
            out_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[tile, :, pl.ds(column_block * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((bm, bn), dtype))


def grouped_matmul_mgpu(
    lhs: Float[Array, "num_rows in_features"],
    rhs: Float[Array, "num_groups in_features out_features"],
    group_sizes: Int[Array, " num_groups"],
    *,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
    interpret=None,
) -> Float[Array, "num_rows out_features"]:
    """``lhs[rows of g] @ rhs[g]`` for every group ``g`` (float32 accumulation, ``lhs``'s dtype), as
    ``grouped_matmul``; ``sum(group_sizes)`` must be ``num_rows``.

    Each tile's rows are gathered into a block of their own (``[num_tiles, block_m, in]``, zeros past a
    tile's rows) so that every TMA copy starts on a whole 8-row tile of the tiled layout, and the outputs
    come back from the same blocks.
    """
    num_rows, in_features = lhs.shape
    num_groups, _, out_features = rhs.shape
    if in_features % config.block_k or out_features % config.block_n:
        raise ValueError(
            f"in_features {in_features} and out_features {out_features} must be multiples of "
            f"block_k {config.block_k} and block_n {config.block_n}"
        )
    bm = config.block_m
    fields = tile_schedule(group_sizes, num_rows, bm)
    num_tiles = fields.shape[0]
    rows = fields[:, ROW_START, None] + jnp.arange(bm, dtype=jnp.int32)  # [num_tiles, block_m]
    held = jnp.arange(bm) < fields[:, NUM_ROWS, None]
    blocks = jnp.where(held[..., None], lhs[jnp.clip(rows, 0, num_rows - 1)], jnp.zeros((), lhs.dtype))
    out_blocks = plgpu.kernel(
        functools.partial(_kernel_body, config=config),
        out_type=jax.ShapeDtypeStruct((num_tiles, bm, out_features), lhs.dtype),
        grid=(num_tiles, out_features // config.block_n),
        grid_names=("tile", "column_block"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(fields, blocks, rhs.astype(lhs.dtype))
    # Each row's place among the blocks (every row is in exactly one tile).
    place = (
        jnp.zeros(num_rows, jnp.int32)
        .at[jnp.where(held, rows, num_rows)]
        .set(jnp.arange(num_tiles * bm, dtype=jnp.int32).reshape(num_tiles, bm), mode="drop")
    )
    return out_blocks.reshape(num_tiles * bm, out_features)[place]
