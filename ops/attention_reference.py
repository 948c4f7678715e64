"""Ragged paged attention in pure JAX: the oracle for the kernels and the fallback anywhere.

One call serves a mixed batch (decodes, chunked and full prefills) packed along the
token axis, reading keys and values from the paged cache through the block tables.

Memory stays bounded without materialising ``[tokens, context]``:

* Query tiles. The packed tokens are cut into tiles of ``query_tile`` consecutive
  tokens of one request (a request's last tile may be short). A tile gathers its
  request's keys once for all its rows, so a long prefill does not copy its keys
  per token; a decode is a tile of its own.
* Key chunks. A ``lax.fori_loop``, as long as the batch's longest span of keys
  (a traced value), walks every tile over ``chunk_blocks`` cache blocks at a time
  with an online softmax (running max and sum) in float32.

Both sizes are static, chosen by :func:`chunk_plan` so that the largest per-chunk
tensor (the gathered K or V chunk, or the scores) stays under an element budget.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.ops.attention_metadata import AttentionMetadata

MAX_CHUNK_ELEMENTS = 1 << 25
"""Default bound on the elements of any one per-chunk tensor (128 MiB in float32)."""


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Static tiling of one attention call: query tile length, tile count, blocks per chunk."""

    query_tile: int
    num_tiles: int
    chunk_blocks: int

    def chunk_elements(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
        """Elements of the largest per-chunk tensor: the K (or V) gather or the scores."""
        keys = self.chunk_blocks * block_size
        return self.num_tiles * keys * max(num_kv_heads * head_dim, self.query_tile * num_q_heads)


def _max_tiles(num_tokens: int, num_reqs: int, query_tile: int) -> int:
    """Most tiles ``num_reqs`` requests sharing ``num_tokens`` tokens can need.

    ``sum(ceil(q_r / tile)) <= (num_tokens + num_reqs * (tile - 1)) / tile``, and a tile
    holds at least one token.
    """
    return min(num_tokens, (num_tokens + num_reqs * (query_tile - 1)) // query_tile)


def chunk_plan(
    num_tokens: int,
    num_reqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks_per_req: int,
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
) -> ChunkPlan:
    """Pick the query tile and the chunk length (in blocks) for these static shapes.

    The tile (a power of two up to ``num_tokens``) minimises the elements per key of
    the largest per-chunk tensor, preferring the shorter tile on ties (less padding);
    the chunk then takes as many blocks as the budget allows, at least one and at most
    a whole block table.
    """
    candidates = [1 << i for i in range(max(num_tokens, 1).bit_length())]
    plans = [ChunkPlan(tile, _max_tiles(num_tokens, num_reqs, tile), 1) for tile in candidates]
    best = min(plans, key=lambda p: p.chunk_elements(num_q_heads, num_kv_heads, head_dim, block_size))
    per_block = best.chunk_elements(num_q_heads, num_kv_heads, head_dim, block_size)
    chunk_blocks = min(max(max_chunk_elements // per_block, 1), max_blocks_per_req)
    return dataclasses.replace(best, chunk_blocks=chunk_blocks)


class _Tiles(NamedTuple):
    """Per query tile: its request, first packed token, valid length and first position."""

    req: Int[Array, " num_tiles"]
    start: Int[Array, " num_tiles"]
    length: Int[Array, " num_tiles"]
    first_pos: Int[Array, " num_tiles"]


def _query_tiles(metadata: AttentionMetadata, query_tile: int, num_tiles: int) -> _Tiles:
    """Cut every request's query tokens into tiles; unused tiles get length 0."""
    qsl = metadata.query_start_loc
    num_reqs = metadata.seq_lens.shape[0]
    tiles_per_req = (qsl[1:] - qsl[:-1] + query_tile - 1) // query_tile
    tiles_end = jnp.cumsum(tiles_per_req)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(tiles_end, tile, side="right"), num_reqs - 1).astype(jnp.int32)
    start = qsl[req] + (tile - (tiles_end[req] - tiles_per_req[req])) * query_tile
    end = qsl[req + 1]
    length = jnp.where(tile < tiles_end[-1], jnp.clip(end - start, 0, query_tile), 0)
    first_pos = metadata.seq_lens[req] - (end - start)
    return _Tiles(req, start, length, first_pos)


class _Softmax(NamedTuple):
    """Online softmax state per (tile, kv head, group, row): running max, sum, numerator."""

    max: Float[Array, "num_tiles num_kv_heads group query_tile"]
    sum: Float[Array, "num_tiles num_kv_heads group query_tile"]
    acc: Float[Array, "num_tiles num_kv_heads group query_tile head_dim"]


def _softmax_step(
    state: _Softmax,
    scores: Float[Array, "num_tiles num_kv_heads group query_tile chunk_keys"],
    mask: Bool[Array, "num_tiles 1 1 query_tile chunk_keys"],
    v: Float[Array, "num_tiles chunk_keys num_kv_heads head_dim"],
) -> _Softmax:
    """Fold one chunk of masked scores and values into the online softmax.

    Rows with no visible key so far keep max -inf; the shift used for them is 0, so
    nothing turns into NaN.
    """
    scores = jnp.where(mask, scores, -jnp.inf)
    new_max = jnp.maximum(state.max, scores.max(axis=-1))
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(scores - shift[..., None])
    rescale = jnp.exp(state.max - shift)
    return _Softmax(
        max=new_max,
        sum=rescale * state.sum + p.sum(axis=-1),
        acc=rescale[..., None] * state.acc + jnp.einsum("nkgqc,nckd->nkgqd", p, v),
    )


def _gather_blocks(
    cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"], block_ids: Int[Array, "num_tiles chunk_blocks"]
) -> Float[Array, "num_tiles chunk_keys num_kv_heads head_dim"]:
    """The cache blocks ``block_ids`` per tile, flattened to consecutive keys, in float32."""
    blocks = jnp.take(cache, block_ids, axis=0, mode="clip")
    tiles, num_blocks, block_size = blocks.shape[:3]
    return blocks.reshape(tiles, num_blocks * block_size, *cache.shape[2:]).astype(jnp.float32)


def ragged_paged_attention_reference(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    v_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
) -> Float[Array, "num_tokens num_q_heads head_dim"]:
    """Causal attention of packed query tokens over their requests' paged K/V.

    Token ``t`` of request ``r`` sits at position ``seq_lens[r] - (query_start_loc[r+1] - t)``
    and sees key positions ``j <= pos``, and ``j > pos - sliding_window`` with a window
    (HF convention: ``sliding_window`` keys including itself). ``soft_cap`` maps scaled
    scores to ``soft_cap * tanh(s / soft_cap)``. None (or 0) turns either off. Query head
    ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``. The current step's K/V
    must already be in the cache, in any float dtype (FP8 too: its values are read as
    stored, see :func:`jaxrunner.ops.ragged_paged_attention` for scales). Padded tokens
    and requests give zeros. Accumulates in float32; returns q's dtype. ``max_chunk_elements`` bounds per-chunk memory.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs, max_blocks = metadata.block_tables.shape
    group = num_q_heads // num_kv_heads
    plan = chunk_plan(
        num_tokens, num_reqs, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, max_chunk_elements
    )
    tile_rows = jnp.arange(plan.query_tile, dtype=jnp.int32)
    chunk_keys = plan.chunk_blocks * block_size

    tiles = _query_tiles(metadata, plan.query_tile, plan.num_tiles)
    row_valid = tile_rows[None, :] < tiles.length[:, None]
    q_pos = tiles.first_pos[:, None] + tile_rows[None, :]
    token = tiles.start[:, None] + tile_rows[None, :]
    q_tiles = q[jnp.clip(token, 0, num_tokens - 1)].astype(jnp.float32)
    q_tiles = q_tiles.reshape(plan.num_tiles, plan.query_tile, num_kv_heads, group, head_dim)

    # First block any row of the tile may see, and the keys each tile has to walk.
    first_block = jnp.zeros_like(tiles.first_pos)
    if sliding_window:
        first_block = jnp.maximum(tiles.first_pos - sliding_window + 1, 0) // block_size
    key_span = jnp.where(tiles.length > 0, tiles.first_pos + tiles.length - first_block * block_size, 0)
    num_chunks = (key_span.max() + chunk_keys - 1) // chunk_keys
    block_table = metadata.block_tables[tiles.req]

    def chunk(c: Int[Array, ""], state: _Softmax) -> _Softmax:
        block_idx = first_block[:, None] + c * plan.chunk_blocks + jnp.arange(plan.chunk_blocks)
        block_ids = jnp.take_along_axis(block_table, jnp.clip(block_idx, 0, max_blocks - 1), axis=1)
        k = _gather_blocks(k_cache, block_ids)
        v = _gather_blocks(v_cache, block_ids)
        k_pos = first_block[:, None] * block_size + c * chunk_keys + jnp.arange(chunk_keys)
        visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & row_valid[:, :, None]
        if sliding_window:
            visible &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
        scores = jnp.einsum("nqkgd,nckd->nkgqc", q_tiles, k) * sm_scale
        if soft_cap:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        return _softmax_step(state, scores, visible[:, None, None], v)

    shape = (plan.num_tiles, num_kv_heads, group, plan.query_tile)
    init = _Softmax(
        max=jnp.full(shape, -jnp.inf, jnp.float32),
        sum=jnp.zeros(shape, jnp.float32),
        acc=jnp.zeros((*shape, head_dim), jnp.float32),
    )
    state = jax.lax.fori_loop(0, num_chunks, chunk, init)

    total = state.sum[..., None]
    out_tiles = jnp.where(total > 0, state.acc / jnp.where(total > 0, total, 1.0), 0.0)
    out_tiles = out_tiles.transpose(0, 3, 1, 2, 4).reshape(-1, num_q_heads, head_dim)
    rows = jnp.where(row_valid, token, num_tokens).reshape(-1)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    return out.at[rows].set(out_tiles, mode="drop").astype(q.dtype)
