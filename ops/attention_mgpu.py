"""Ragged paged attention as a Mosaic GPU (Pallas) kernel for NVIDIA Hopper.

Same contract as :func:`ragged_paged_attention_reference`, the oracle it is tested
against. One kernel serves decodes, chunked and full prefills packed in one batch.

Layout of the work:

* Query rows. For kv head ``h`` the ``G = num_q_heads // num_kv_heads`` query heads
  that read it are laid out token-major as rows ``t * G + g``, so all heads of one
  KV head share every K/V page read (GQA), and a decode of one token still fills
  ``G`` rows of the tensor-core tile.
* Tiles. Every request's rows are cut into tiles of ``64 * num_compute_wgs`` rows (a
  request's last tile may be short), gathered tile-major so that every tile starts on
  a tile boundary. One program owns one (KV split, tile, kv head):
  each compute warpgroup holds 64 rows of the tile and both walk the same KV stages.
* KV pipeline. A producer warpgroup reads the request's block table from GMEM and
  issues one TMA copy per cache page (``[block_size, head_dim]`` of one kv head) into
  a ``num_stages``-deep ring of shared-memory stages of ``pages_per_stage`` pages;
  compute warpgroups run ``Q K^T`` and ``P V`` on the tensor cores (wgmma) with an
  online softmax in registers, and release each stage through an mbarrier.
* Masks. Only the stages that cross a row's causal edge or window edge compute a
  mask; the stages every row sees whole skip it.
* Tuning (:class:`KernelConfig`, chosen by :func:`choose_config`'s table): stage and
  ring sizes, compute warpgroups, KV splits, and three switches measured by
  ``benchmarks/attention_step.py --sweep``: a register split between compute and
  copy warpgroups, in-place ``P V`` accumulation, and ping-pong of two compute
  warpgroups on the tensor cores.
* Flash decoding. With ``num_kv_splits > 1`` each tile's KV range is cut into that
  many contiguous stage ranges, each written as a partial output (in q's dtype)
  with its log-sum-exp, combined afterwards in XLA, so a batch of one long request
  still fills the GPU.

Outputs go to a tile-major buffer (every tile writes whole 64-row blocks, so no
program writes another's rows) and one gather puts rows back in token order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from jaxrunner.ops.attention_metadata import AttentionMetadata

ROWS_PER_WG = 64
"""Query rows per compute warpgroup: the M of one wgmma."""

COPY_REGISTERS = 40
"""Registers per thread left to the copy warpgroup when compute warpgroups take more."""

MASKED = -1e30
"""Score of a masked key (log2 domain): finite, so fully masked rows never make NaN."""

LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning of one kernel launch."""

    pages_per_stage: int
    """Cache pages copied per pipeline stage (the stage's keys: pages x block_size)."""
    num_stages: int
    """Stages in flight in the shared-memory ring."""
    num_compute_wgs: int
    """Compute warpgroups per program (1 or 2); a tile holds 64 rows per warpgroup."""
    num_kv_splits: int
    """Programs sharing one tile's KV range (flash decoding); 1 for no split."""
    compute_registers: int | None = None
    """Registers per thread the compute warpgroups take from the copy warpgroup
    (``setmaxnreg``; the copy warpgroup drops to ``COPY_REGISTERS``); None leaves
    the compiler's even split."""
    accumulate_in_place: bool = False
    """Rescale the output accumulator and let ``P V`` accumulate into it (one
    accumulator live instead of two)."""
    pingpong: bool = False
    """With two compute warpgroups, take turns on the tensor cores: one runs its
    softmax while the other's matmuls run. Not in the interpreter tests: one CI run
    of it under the Mosaic GPU interpreter hung (passes elsewhere; the sweep checks
    it against the reference on the GPU)."""
    longest_first: bool = False
    """Launch each kv head's tiles last to first, one kv head after another (the default
    launches each tile's kv heads together, first tile first): a request's later tiles
    see more keys (causal), so the last wave holds short programs instead of the longest."""

    def __post_init__(self):
        if self.pingpong and self.num_compute_wgs != 2:
            raise ValueError(f"pingpong needs two compute warpgroups, got {self.num_compute_wgs}")

    @property
    def tile_rows(self) -> int:
        """Query rows per tile: 64 per compute warpgroup."""
        return ROWS_PER_WG * self.num_compute_wgs


class TileSchedule(NamedTuple):
    """Per tile (a grid index): the int32 fields the kernel reads, as ``[tiles, 8]``.

    Columns: request, first q row (in the ``[tokens * G]`` row space), valid rows,
    the tile's first row within its request, the request's first query position,
    first and end key position, and one unused.
    """

    fields: Int[Array, "tiles 8"]
    tile_start: Int[Array, "num_reqs"]
    """First tile of each request, to map rows back to their tiles."""


REQ, Q_ROW, NUM_ROWS, ROW_OFFSET, Q_POS0, KV_START, KV_END = range(7)


def num_tiles_bound(num_tokens: int, num_reqs: int, group: int, tile_rows: int) -> int:
    """Most tiles ``num_reqs`` requests sharing ``num_tokens`` tokens can need."""
    return min(num_tokens * group, (num_tokens * group + num_reqs * (tile_rows - 1)) // tile_rows)


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
    if sliding_window:
        kv_start = jnp.maximum(first_pos - sliding_window + 1, 0)
    q_row = jnp.where(num_rows > 0, qsl[req] * group + row_offset, 0)  # unused tiles gather row 0
    fields = jnp.stack(
        [req, q_row, num_rows, row_offset, q_pos0, kv_start, kv_end, jnp.zeros_like(req)], axis=1
    ).astype(jnp.int32)
    return TileSchedule(fields, tile_start)


def _kernel_body(
    sched_ref,
    block_tables_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    *,
    config: KernelConfig,
    group: int,
    block_size: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpreted: bool,
):
    """One program: (split, tile, kv head). Warpgroups ``0..n-1`` compute, ``n`` copies."""
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    n_wg = config.num_compute_wgs
    pages = config.pages_per_stage
    stages = config.num_stages
    stage_keys = pages * block_size
    max_blocks = block_tables_ref.shape[1]

    if interpreted:  # the interpreter takes no layout hints
        iota = functools.partial(lax.broadcasted_iota, jnp.int32)
        wgmma_layout = lambda x: x  # noqa: E731
    else:
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)
        wgmma_layout = _wgmma_layout

    split = lax.axis_index("split")
    tile = lax.axis_index("tile")
    if config.longest_first:
        tile = sched_ref.shape[0] - 1 - tile
    kv_head = lax.axis_index("kv_head")
    req = sched_ref[tile, REQ]
    num_rows = sched_ref[tile, NUM_ROWS]
    kv_start = sched_ref[tile, KV_START]
    kv_end = sched_ref[tile, KV_END]

    first_stage = kv_start // stage_keys
    end_stage = (kv_end + stage_keys - 1) // stage_keys
    per_split = (end_stage - first_stage + config.num_kv_splits - 1) // config.num_kv_splits
    lo = jnp.minimum(first_stage + split * per_split, end_stage)
    hi = jnp.minimum(lo + per_split, end_stage)
    num_steps = jnp.where(num_rows > 0, hi - lo, 0)

    # Stages every row of the tile sees whole (no causal or window mask): [full_lo, full_hi).
    first_pos = sched_ref[tile, Q_POS0] + sched_ref[tile, ROW_OFFSET] // group
    full_hi = jnp.clip((first_pos + 1) // stage_keys, lo, hi)
    full_lo = lo
    if sliding_window:
        full_lo = jnp.clip((kv_end - sliding_window + stage_keys - 1) // stage_keys, lo, full_hi)

    def scoped(q_smem, lse_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free, turn):
        wg = lax.axis_index("wg")

        def rendezvous():
            """Both compute warpgroups meet; offset by one meeting, they alternate."""
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < n_wg)
        def _compute():
            if config.compute_registers:
                plgpu.set_max_registers(config.compute_registers, action="increase")
            row0 = tile * config.tile_rows + wg * ROWS_PER_WG
            plgpu.copy_gmem_to_smem(
                q_ref.at[kv_head, pl.ds(row0, ROWS_PER_WG)], q_smem.at[wg], q_bar.at[wg]
            )
            m = wgmma_layout(jnp.full((ROWS_PER_WG,), MASKED, jnp.float32))
            l = wgmma_layout(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32))
            acc = wgmma_layout(jnp.zeros((ROWS_PER_WG, head_dim), jnp.float32))
            plgpu.barrier_wait(q_bar.at[wg])

            def visible(stage):
                """Causal (and window) mask of one stage's keys for this warpgroup's rows."""
                rows = iota((ROWS_PER_WG, stage_keys), 0)
                k_pos = stage * stage_keys + iota((ROWS_PER_WG, stage_keys), 1)
                row_in_req = sched_ref[tile, ROW_OFFSET] + wg * ROWS_PER_WG + rows
                q_pos = sched_ref[tile, Q_POS0] + row_in_req // group
                seen = k_pos <= q_pos
                if sliding_window:
                    seen &= k_pos > q_pos - sliding_window
                return seen

            def step(stage, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(stage - lo, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                s = _scores(q_smem.at[wg], k_smem.at[slot], interpreted, rendezvous if config.pingpong else None)
                plgpu.barrier_arrive(k_free.at[slot])
                if soft_cap:
                    s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2_E)
                else:
                    s = s * (sm_scale * LOG2_E)
                if masked:
                    s = jnp.where(visible(stage), s, MASKED)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                if config.pingpong:  # softmax done; P V waits for the tensor cores' turn
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_wait(turn)
                else:
                    plgpu.barrier_wait(v_bar.at[slot])
                acc = _accumulate_values(
                    acc, alpha, p.astype(dtype), v_smem.at[slot], config.accumulate_in_place, interpreted
                )
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = (acc, m, l)
            end = jnp.where(num_rows > 0, hi, lo)
            bounds = (lo, jnp.minimum(full_lo, end), jnp.minimum(full_hi, end), end)
            if config.pingpong:
                pl.when(wg == 1)(rendezvous)  # warpgroup 0 goes first
            for (a, b), masked in zip(zip(bounds[:-1], bounds[1:]), (True, False, True)):
                carry = lax.fori_loop(a, b, functools.partial(step, masked=masked), carry)
            if config.pingpong:
                pl.when(wg == 0)(rendezvous)  # and meets warpgroup 1's last turn
            acc, m, l = carry
            l_safe = jnp.maximum(l, 1e-30)
            q_smem.at[wg][...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
            if lse_smem is not None:
                lse_smem.at[wg][...] = m + jnp.log2(l_safe)
            plgpu.commit_smem()
            out_row = tile * config.tile_rows + wg * ROWS_PER_WG
            plgpu.copy_smem_to_gmem(q_smem.at[wg], out_ref.at[split, kv_head, pl.ds(out_row, ROWS_PER_WG)])
            if lse_smem is not None:
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[split, kv_head, pl.ds(out_row, ROWS_PER_WG)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _copy():
            if config.compute_registers:
                plgpu.set_max_registers(COPY_REGISTERS, action="decrease")

            def page_ids(i):
                """Cache pages of the tile's stage ``i``: read from the block table once for K and V."""
                return [
                    jnp.maximum(block_tables_ref[req, jnp.minimum((lo + i) * pages + p, max_blocks - 1)], 0)
                    for p in range(pages)
                ]

            def issue(i, ids):
                slot = lax.rem(i, stages)
                for cache, smem, bar in ((k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)):
                    for p, page in enumerate(ids):
                        dst = pl.ds(p * block_size, block_size)
                        plgpu.copy_gmem_to_smem(cache.at[page, :, kv_head], smem.at[slot, dst], bar.at[slot])

            for i in range(stages):
                pl.when(i < num_steps)(lambda i=i: issue(i, page_ids(i)))

            @pl.loop(0, jnp.maximum(num_steps - stages, 0))
            def _refill(i):
                ids = page_ids(i + stages)  # the table reads overlap the wait for a free slot
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                issue(i + stages, ids)

            # Observe the last releases too, so every barrier phase is waited on once.
            @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
            def _drain(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    tiled = _smem_transforms(dtype)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((n_wg, ROWS_PER_WG, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((n_wg, ROWS_PER_WG), jnp.float32) if lse_ref is not None else None,
        plgpu.SMEM((stages, stage_keys, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, stage_keys, head_dim), dtype, transforms=tiled),
        plgpu.Barrier(num_barriers=n_wg),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg) if config.pingpong else None,
        collective_axes="wg",
    )


# The interpreter's wgmma takes neither transposed nor register operands; it computes
# a plain float32 matmul anyway, so under it both products come from the loaded tiles.


def _scores(q_smem, k_smem, interpreted: bool, after_issue=None) -> Float[Array, "rows keys"]:
    """``Q K^T`` in float32 on the tensor cores (wgmma, K transposed in shared memory).

    ``after_issue`` runs while the matmul is in flight, before its result is read.
    """
    if interpreted:
        scores = jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)
        if after_issue:
            after_issue()
        return scores

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
        if after_issue:
            after_issue()
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32))


def _accumulate_values(
    acc: Float[Array, "rows head_dim"],
    alpha: Float[Array, "rows"],
    p: Float[Array, "rows keys"],
    v_smem,
    in_place: bool,
    interpreted: bool,
) -> Float[Array, "rows head_dim"]:
    """``acc * alpha + P V`` in float32 on the tensor cores (P from registers, V in shared memory)."""
    scale = lax.broadcast_in_dim(alpha, acc.shape, [0])
    if interpreted:
        return acc * scale + jnp.dot(p, v_smem[...], preferred_element_type=jnp.float32)

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem)

    if in_place:
        return pl.run_state(pv)(plgpu.ACC.init(acc * scale))

    def fresh(acc_ref):
        pv(acc_ref)
        return acc_ref[...]

    pv_out = pl.run_scoped(fresh, plgpu.ACC((p.shape[0], v_smem.shape[1]), jnp.float32))
    return acc * scale + pv_out


def _wgmma_layout(x: Array) -> Array:
    """Pin a row vector (or a row-major tile) to the layout of wgmma accumulators' rows."""
    layout = plgpu.Layout.WGMMA.reduce(1) if x.ndim == 1 else plgpu.Layout.WGMMA
    return plgpu.layout_cast(x, layout)


def _smem_transforms(dtype) -> tuple:
    """128-byte swizzled tiles of 8 rows: the shared-memory layout wgmma and TMA want."""
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


SUPPORTED_HEAD_DIMS = (64, 128, 256)
SHARED_MEMORY_BYTES = (227 - 3) * 1024
"""Shared memory for a program's queries, ring and log-sum-exps: Hopper's 227 KiB a block, less
3 KiB for barriers and scratch (a prefill program of three 64 KiB stages took 2.7 KiB more)."""
PREFILL_COMPUTE_REGISTERS = 232
"""Registers per thread for each of two compute warpgroups (the copy warpgroup keeps 40)."""
MIN_STAGES_PER_SPLIT = 2
"""Splitting shorter than this costs more in per-program setup and combining than it gains
(at decode 1 x 1k, splits of two stages beat splits of one in device time)."""
PROGRAM_SETUP_STAGES = 2.0
"""A program's fixed cost (queries in, pipeline fill, output out), in stages of streaming time:
16 x 1k in two splits (two waves) took 3.8 us more than unsplit, at 1.8 us a stage."""
SPLIT_COMBINE_STAGES = 0.35
"""What each further split adds to the combine, in stages of streaming time: 0.26 us a split
at 1 x 1k (a fit of its sweep), at 0.73 us a stage."""


def choose_splits(programs: int, kv_stages: int, num_sms: int) -> int:
    """KV splits that minimise the modelled time of a grid of ``programs`` (tiles x kv heads)
    streaming ``kv_stages`` each: waves of one program per SM, each wave as long as its
    longest program (a split streams whole stages: the ceiling of its share) plus its fixed
    cost, plus the combine.

    The constants come from the device times of the H100 sweeps (``attention_step.py
    --sweep``), where 16 x 1k was fastest unsplit (128 programs; 1.15x two splits) and
    1 x 1k with 8 splits (two whole stages each: 10.7 us against 11.6 with 7, whose
    longest split streams three). Every other shape's choice is the model's, not measured.
    A grid that already fills the SMs once is not split: unsplit, 64 x 4k and 256 x 32k
    read their KV at 94-100% of the copy rate.
    """
    if programs >= num_sms:
        return 1
    most = max(kv_stages // MIN_STAGES_PER_SPLIT, 1)

    def modelled_time(splits: int) -> float:
        waves = -(-programs * splits // num_sms)
        return waves * (-(-kv_stages // splits) + PROGRAM_SETUP_STAGES) + SPLIT_COMBINE_STAGES * splits

    return min(range(1, most + 1), key=modelled_time)


def program_shared_memory(config: KernelConfig, head_dim: int, block_size: int, itemsize: int) -> int:
    """Shared-memory bytes of one program's queries, K/V ring and (when split) log-sum-exps,
    the part ``SHARED_MEMORY_BYTES`` bounds."""
    queries = config.num_compute_wgs * ROWS_PER_WG * head_dim * itemsize
    ring = config.num_stages * config.pages_per_stage * block_size * 2 * head_dim * itemsize
    lse = config.num_compute_wgs * ROWS_PER_WG * 4 if config.num_kv_splits > 1 else 0
    return queries + ring + lse


def kernel_supports(dtype, head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs this case on a GPU: 16-bit caches, its head dims, pages that tile
    a stage of a multiple of 64 keys (8-row-aligned, and either dividing 64 or a multiple of it),
    and room in shared memory for the smallest split prefill program (two stages of one such stage each)."""
    smallest_prefill = KernelConfig(
        pages_per_stage=max(64 // block_size, 1), num_stages=2, num_compute_wgs=2, num_kv_splits=2
    )
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim in SUPPORTED_HEAD_DIMS
        and block_size % 8 == 0
        and (64 % block_size == 0 or block_size % 64 == 0)
        and program_shared_memory(smallest_prefill, head_dim, block_size, jnp.dtype(dtype).itemsize)
        <= SHARED_MEMORY_BYTES
    )


def choose_config(
    num_tokens: int,
    num_reqs: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks_per_req: int,
    itemsize: int,
    num_sms: int = 132,
) -> KernelConfig:
    """The tuning table: static shapes -> launch parameters.

    Decode-like batches (at most 64 query rows per request) use one compute
    warpgroup, 64-key stages in a ring of about 96 KiB (two programs can share an
    SM) and in-place ``P V`` accumulation; KV splits by :func:`choose_splits`, over the
    stages of the longest possible request (the block table's width). In place: 1.17x
    and 1.20x faster at decode 1 x 1k and 16 x 1k in the H200 sweep (``attention_step.py --sweep``).

    Prefills use two compute warpgroups in ping-pong with the register split and
    in-place accumulation, tiles launched longest first, and 128-key stages in as many
    as three ring stages as shared memory holds beside the queries: on the H100 at
    1 x 8k each switch was faster in the sweep (ping-pong with registers and in place
    1.05x, longest first 1.06x, both 1.15x; a third stage 1.02x more).
    """
    decode_like = num_tokens * group <= num_reqs * ROWS_PER_WG
    n_wg = 1 if decode_like else 2
    key_bytes = 2 * head_dim * itemsize  # one key's K and V
    query_bytes = n_wg * ROWS_PER_WG * head_dim * itemsize
    ring_bytes = 96 * 1024 if decode_like else SHARED_MEMORY_BYTES - query_bytes
    # Keys per stage: a multiple of 64 (the K of one 128-byte-swizzled bf16 wgmma), two stages in the ring.
    stage_keys = max(min(64 if decode_like else 128, ring_bytes // (2 * key_bytes)) // 64 * 64, 64)
    pages = max(stage_keys // block_size, 1)  # pages larger than a stage make a stage of one page
    stage_bytes = pages * block_size * key_bytes
    tiles = num_tiles_bound(num_tokens, num_reqs, group, ROWS_PER_WG * n_wg)
    if decode_like:
        # Work in about one tile per request; the rest of the bound is padding.
        splits = choose_splits(min(tiles, num_reqs) * num_kv_heads, -(-max_blocks_per_req // pages), num_sms)
        return KernelConfig(pages_per_stage=pages, num_stages=max(2, min(4, ring_bytes // stage_bytes)),
                            num_compute_wgs=1, num_kv_splits=splits, accumulate_in_place=True)
    splits = choose_splits(tiles * num_kv_heads, -(-max_blocks_per_req // pages), num_sms)
    two_stages = KernelConfig(pages_per_stage=pages, num_stages=2, num_compute_wgs=2, num_kv_splits=splits,
                              compute_registers=PREFILL_COMPUTE_REGISTERS, accumulate_in_place=True, pingpong=True,
                              longest_first=True)
    three_stages = dataclasses.replace(two_stages, num_stages=3)
    fits = program_shared_memory(three_stages, head_dim, block_size, itemsize) <= SHARED_MEMORY_BYTES
    return three_stages if fits else two_stages


def config_for(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    metadata: AttentionMetadata,
) -> KernelConfig:
    """The tuning table's choice for this call's static shapes."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs, max_blocks = metadata.block_tables.shape
    return choose_config(
        num_tokens, num_reqs, num_q_heads // num_kv_heads, num_kv_heads, head_dim, block_size, max_blocks,
        q.dtype.itemsize,
    )


def prepare_tiles(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    num_kv_heads: int,
    metadata: AttentionMetadata,
    config: KernelConfig,
    sliding_window: int | None,
) -> tuple[TileSchedule, Float[Array, "num_kv_heads tile_rows_total head_dim"]]:
    """The kernel's inputs besides the caches: the tile schedule and the tile-major queries."""
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    num_reqs = metadata.block_tables.shape[0]
    num_tiles = num_tiles_bound(num_tokens, num_reqs, group, config.tile_rows)
    schedule = tile_schedule(metadata, group, config.tile_rows, num_tiles, sliding_window)
    return schedule, tile_major_queries(q, schedule, num_kv_heads, config.tile_rows)


def tile_major_queries(
    q: Float[Array, "num_tokens num_q_heads head_dim"], schedule: TileSchedule, num_kv_heads: int, tile_rows: int
) -> Float[Array, "num_kv_heads tile_rows_total head_dim"]:
    """q as ``[kv_heads, tiles * tile_rows, head_dim]``, each tile's rows starting at a tile boundary.

    TMA copies into tiled shared memory need 8-row-aligned starts, which a request's
    first row (``query_start * G``) need not be; rows past a tile's valid ones are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    fields = schedule.fields
    r = jnp.arange(tile_rows, dtype=jnp.int32)[None, :]
    row = fields[:, Q_ROW, None] + r
    valid = r < fields[:, NUM_ROWS, None]
    token = jnp.where(valid, row // group, 0).reshape(-1)
    head_in_group = jnp.where(valid, row % group, 0).reshape(-1)
    grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    rows = grouped[token, :, head_in_group]  # [tiles * tile_rows, kv_heads, head_dim]
    rows = jnp.where(valid.reshape(-1)[:, None, None], rows, 0)
    return rows.transpose(1, 0, 2)


def _gather_rows(
    metadata: AttentionMetadata, schedule: TileSchedule, num_tokens: int, group: int, tile_rows: int
) -> tuple[Int[Array, "num_tokens group"], Array]:
    """Index of each (token, head-in-group) row in the tile-major output, and token validity."""
    qsl = metadata.query_start_loc
    num_reqs = metadata.seq_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(qsl[1:], token, side="right", method="compare_all"), num_reqs - 1)
    row_in_req = (token - qsl[req])[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]
    tile = schedule.tile_start[req][:, None] + row_in_req // tile_rows
    index = tile * tile_rows + row_in_req % tile_rows
    valid = token < qsl[-1]
    return jnp.where(valid[:, None], index, 0), valid


def launch_kernel(
    schedule_fields: Int[Array, "tiles 8"],
    block_tables: Int[Array, "num_reqs max_blocks"],
    q_tiles: Float[Array, "num_kv_heads tile_rows_total head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    v_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    *,
    config: KernelConfig,
    group: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret=None,
) -> list[Array]:
    """The kernel alone: tile-major partial outputs ``[splits, kv_heads, rows, head_dim]``
    and, with splits, their log-sum-exps ``[splits, kv_heads, rows]`` (log2 domain)."""
    num_kv_heads, out_rows, head_dim = q_tiles.shape
    num_tiles = out_rows // config.tile_rows
    splits = config.num_kv_splits
    out_type = [jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows, head_dim), q_tiles.dtype)]
    if splits > 1:
        out_type.append(jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows), jnp.float32))
    body = functools.partial(
        _kernel_body,
        config=config,
        group=group,
        block_size=k_cache.shape[1],
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpreted=interpret is not None,
    )

    def entry(sched_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, lse_ref=None):
        body(sched_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, lse_ref)

    # The last grid axis varies fastest in launch order (Mosaic GPU makes it CUDA's x).
    axes = {"split": splits, "tile": num_tiles, "kv_head": num_kv_heads}
    order = ("split", "kv_head", "tile") if config.longest_first else ("split", "tile", "kv_head")
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=tuple(axes[name] for name in order),
        grid_names=order,
        num_threads=config.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(schedule_fields, block_tables, q_tiles, k_cache, v_cache)


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

    ``config`` overrides the tuning table; ``interpret`` (an ``InterpretGPUParams``)
    runs the kernel through the Mosaic GPU interpreter on the CPU. Jitted, so that a
    model calling it once per layer lowers (and compiles) the kernel once per shape.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    config = config or config_for(q, k_cache, metadata)
    tile_rows = config.tile_rows
    schedule, q_tiles = prepare_tiles(q, num_kv_heads, metadata, config, sliding_window)
    results = launch_kernel(
        schedule.fields,
        metadata.block_tables.astype(jnp.int32),
        q_tiles,
        k_cache,
        v_cache,
        config=config,
        group=group,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
    )
    splits = config.num_kv_splits
    index, valid = _gather_rows(metadata, schedule, num_tokens, group, tile_rows)
    out = results[0][:, :, index]
    if splits > 1:
        lse = results[1][:, :, index]
        weight = jnp.exp2(lse - lse.max(axis=0, keepdims=True))
        out = (out * weight[..., None]).sum(axis=0) / weight.sum(axis=0)[..., None]
    else:
        out = out[0]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
