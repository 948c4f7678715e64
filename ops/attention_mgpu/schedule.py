"""The kernel's tile schedule: which query rows each program owns, and the gathers into and out of tiles.

For kv head ``h`` the ``group = num_q_heads // num_kv_heads`` query heads that read it
are laid out token-major as rows ``t * group + g``, so all heads of one KV head share
every K/V page read (GQA), and a decode of one token still fills ``group`` rows of the
tensor-core tile. Every request's ``q_len * group`` rows are cut into tiles of
``tile_rows`` rows (a request's last tile may be short). The kernel's queries and
outputs hold each tile's rows in granules of 8 (TMA copies into tiled shared memory
need 8-row-aligned starts, which a request's first row, ``query_start * group``, need
not be), the tiles' granules packed back to back: a decode of 4 rows moves one
granule, not a whole 64-row tile.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrunner.ops.attention_metadata import AttentionMetadata

REQ, Q_ROW, NUM_ROWS, ROW_OFFSET, Q_POS0, KV_START, KV_END, GRANULE0 = range(8)
"""Columns of :attr:`TileSchedule.fields`."""

GRANULE_ROWS = 8
"""Rows of one granule: the row alignment of a TMA copy into tiled shared memory."""


class TileSchedule(NamedTuple):
    """Per tile (a grid index): the int32 fields the kernel reads, as ``[num_tiles, 8]``.

    Columns: request, first q row (in the ``[num_tokens * group]`` row space), valid rows,
    the tile's first row within its request, the request's first query position,
    first and end key position, and the tile's first granule in the packed queries and outputs.
    """

    fields: Int[Array, "num_tiles 8"]
    tile_start: Int[Array, " num_reqs"]
    """First tile of each request, to map rows back to their tiles."""


def num_tiles_bound(num_tokens: int, num_reqs: int, group: int, tile_rows: int) -> int:
    """Most tiles ``num_reqs`` requests sharing ``num_tokens`` tokens can need."""
    return min(num_tokens * group, (num_tokens * group + num_reqs * (tile_rows - 1)) // tile_rows)


def num_granules_bound(num_tokens: int, num_reqs: int, group: int, tile_rows: int) -> int:
    """Most granules their tiles can fill (each request's rows rounded up to a granule)."""
    rows = min(
        num_tokens * group + num_reqs * (GRANULE_ROWS - 1),
        num_tiles_bound(num_tokens, num_reqs, group, tile_rows) * tile_rows,
    )
    return max(rows // GRANULE_ROWS, 1)


def tile_schedule(
    metadata: AttentionMetadata,
    group: int,
    tile_rows: int,
    num_tiles: int,
    sliding_window: int | None,
) -> TileSchedule:
    """Cut each request's ``q_len * group`` rows into tiles; unused tiles get 0 rows."""
    qsl = metadata.query_start_loc
    num_reqs = metadata.seq_lens.shape[0]
    q_len = qsl[1:] - qsl[:-1]
    tiles_per_req = (q_len * group + tile_rows - 1) // tile_rows
    tiles_end = jnp.cumsum(tiles_per_req)
    tile_start = (tiles_end - tiles_per_req).astype(jnp.int32)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(tiles_end, tile, side="right", method="compare_all")
    req = jnp.minimum(req, num_reqs - 1).astype(jnp.int32)
    row_offset = (tile - tile_start[req]) * tile_rows
    num_rows = jnp.where(tile < tiles_end[-1], jnp.clip(q_len[req] * group - row_offset, 0, tile_rows), 0)
    q_pos0 = metadata.seq_lens[req] - q_len[req]
    first_pos = q_pos0 + row_offset // group
    kv_end = jnp.where(num_rows > 0, q_pos0 + (row_offset + num_rows - 1) // group + 1, 0)
    kv_start = jnp.zeros_like(kv_end)
    if sliding_window:  # a tile without rows has no keys, wherever its (meaningless) first position falls
        kv_start = jnp.where(num_rows > 0, jnp.maximum(first_pos - sliding_window + 1, 0), 0)
    q_row = jnp.where(num_rows > 0, qsl[req] * group + row_offset, 0)
    granules = (num_rows + GRANULE_ROWS - 1) // GRANULE_ROWS
    granule0 = jnp.cumsum(granules) - granules
    fields = jnp.stack([req, q_row, num_rows, row_offset, q_pos0, kv_start, kv_end, granule0], axis=1).astype(jnp.int32)
    return TileSchedule(fields, tile_start)


def packed_queries(
    q: Float[Array, "num_tokens num_q_heads head_dim"], schedule: TileSchedule, num_kv_heads: int, num_granules: int
) -> Float[Array, "num_kv_heads packed_rows head_dim"]:
    """q as ``[num_kv_heads, num_granules * 8, head_dim]``: each tile's rows from its first granule on;
    rows past a tile's valid ones, and granules no tile fills, are zero.

    One gather of whole ``head_dim`` rows of q (one query head of one token each) straight into
    that layout: no transpose after it, and zero rows come from its fill value, not a select."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    fields = schedule.fields
    granule = jnp.arange(num_granules, dtype=jnp.int32)
    tile = jnp.searchsorted(fields[:, GRANULE0], granule, side="right", method="compare_all") - 1
    row_in_tile = (granule - fields[tile, GRANULE0])[:, None] * GRANULE_ROWS + jnp.arange(GRANULE_ROWS)[None, :]
    valid = (row_in_tile < fields[tile, NUM_ROWS, None]).reshape(-1)
    row = (fields[tile, Q_ROW, None] + row_in_tile).reshape(-1)
    kv_head = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None]
    q_row = (row // group) * num_q_heads + kv_head * group + row % group  # [num_kv_heads, packed_rows]
    q_row = jnp.where(valid, q_row, num_tokens * num_q_heads)  # past the end: filled with zeros
    return jnp.take(q.reshape(-1, head_dim), q_row, axis=0, mode="fill", fill_value=0)


def output_row_index(
    metadata: AttentionMetadata, schedule: TileSchedule, num_tokens: int, group: int, tile_rows: int, packed_shape
) -> Int[Array, "num_tokens num_kv_heads group"]:
    """Row of each (token, kv head, head-in-group) in the packed output viewed as
    ``[num_kv_heads * packed_rows, head_dim]`` (``packed_shape``: ``(num_kv_heads, packed_rows)``);
    padding tokens get a row past the end (a gather's fill)."""
    qsl = metadata.query_start_loc
    num_reqs = metadata.seq_lens.shape[0]
    num_kv_heads, packed_rows = packed_shape
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(qsl[1:], token, side="right", method="compare_all"), num_reqs - 1)
    row_in_req = (token - qsl[req])[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]
    tile = schedule.tile_start[req][:, None] + row_in_req // tile_rows
    index = schedule.fields[tile, GRANULE0] * GRANULE_ROWS + row_in_req % tile_rows  # [num_tokens, group]
    kv_head = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    rows = kv_head * packed_rows + index[:, None, :]
    valid = (token < qsl[-1])[:, None, None]
    return jnp.where(valid, rows, num_kv_heads * packed_rows)
