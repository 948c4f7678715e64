"""The ragged paged attention kernel body for Mosaic GPU (Pallas) on NVIDIA Hopper, and its launch.

A program works through items, each one (KV split, tile, kv head) of the :mod:`schedule`'s
tiles: one item (``num_programs`` None), or with persistent programs every
``num_programs``-th item of the launch order, all through one ring, so that the copy
warpgroup streams the next item's first stages while the compute warpgroups finish the
last. Each compute warpgroup holds 64 rows of a tile and all walk the same KV stages.

* KV pipeline. A producer warpgroup reads the request's block table from GMEM and
  issues one TMA copy per cache page (``[block_size, head_dim]`` of one kv head) into
  a ``num_stages``-deep ring of shared-memory stages of ``pages_per_stage`` pages;
  compute warpgroups run ``Q K^T`` and ``P V`` on the tensor cores (wgmma) with an
  online softmax in registers, and release each stage through an mbarrier.
* Masks. Only the stages that cross a row's causal edge or window edge compute a
  mask; the stages every row sees whole skip it.
* Flash decoding. With ``num_kv_splits > 1`` each tile's KV range is cut into that
  many contiguous stage ranges, each written as a partial output (in q's dtype)
  with its log-sum-exp, for the wrapper to combine.
* FP8 caches. Pages arrive by TMA as FP8 (half the bytes of bf16); the copy
  warpgroup widens each stage's keys and values to q's 16-bit dtype into a second
  ring (``num_widened_stages`` deep), refills the FP8 stage, and the compute
  warpgroups run wgmma on the widened stages exactly as on a 16-bit ring: the
  widening stays off their per-stage chain. With ``num_widening_wgs`` 2, one copy
  warpgroup moves and widens the keys and another the values, side by side. Widening is exact (every FP8 value is
  a float16); the cache's scales are applied outside the kernel. With ``fp8_scores``
  the queries arrive in e4m3 with a scale a row, ``Q K^T`` runs in FP8 on the keys as
  they landed, and only the values are widened.

Queries come from, and outputs go to, the schedule's packed buffers: each warpgroup
copies in its 64 rows as eight 8-row granules (past the tile's last granule, that
granule again: its rows are never written out) and writes back only the granules
that hold its rows, so no program writes another's rows.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from jaxrunner.ops.attention_mgpu.schedule import (
    GRANULE0,
    GRANULE_ROWS,
    KV_END,
    KV_START,
    NUM_ROWS,
    Q_POS0,
    REQ,
    ROW_OFFSET,
)
from jaxrunner.ops.attention_mgpu.tuning import ROWS_PER_WG, SCALE_LANES, KernelConfig

COPY_REGISTERS = 40
"""Registers per thread left to the copy warpgroup when compute warpgroups take more."""
WIDENING_COPY_REGISTERS = 88
"""The same for a copy warpgroup that also widens FP8 stages (64 keys at a time)."""
WIDEN_ROWS = 64
"""Keys widened at a time: one 64-row tile in the 8-bit wgmma layout."""

MASKED = -1e30
"""Score of a masked key (log2 domain): finite, so fully masked rows never make NaN."""

LOG2_E = math.log2(math.e)

GRANULES_PER_WG = ROWS_PER_WG // GRANULE_ROWS


class _Item(NamedTuple):
    """One unit of work, a (KV split, tile, kv head): its request and rows, and its stages ``[lo, hi)``
    (``[full_lo, full_hi)`` the ones every row sees whole: no causal or window mask)."""

    split: Array
    tile: Array
    kv_head: Array
    req: Array
    num_rows: Array
    lo: Array
    hi: Array
    num_steps: Array
    full_lo: Array
    full_hi: Array


class _Stream(NamedTuple):
    """What a copy warpgroup moves for the keys or the values: the cache, the ring its stages land in and
    their landed barriers; the widened ring and its ready barriers (None where the compute warpgroups read
    the stages as they landed); the barriers that release what the compute warpgroups read, and their
    number (the depth of the ring they read). The refs are Pallas refs, which carry no static type."""

    cache: Any
    ring: Any
    landed: Any
    wide: Any
    ready: Any
    free: Any
    num_free: int


def _kernel_body(
    sched_ref,
    block_tables_ref,
    q_ref,
    q_scale_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    *,
    config: KernelConfig,
    num_programs: int,
    group: int,
    block_size: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpreted: bool,
):
    """One program: the items ``program, program + num_programs, ...`` of the launch order, one after
    another through one ring. Warpgroups ``0..n-1`` compute, ``n`` copies (over an FP8 cache with two
    widening warpgroups, ``n`` moves the keys and ``n + 1`` the values). ``q_scale_ref`` (None but with
    ``fp8_scores``): each FP8 query row's scale."""
    head_dim = q_ref.shape[-1]
    dtype = out_ref.dtype  # the 16-bit dtype of the widened stages, of P and of the output
    widen = k_ref.dtype != dtype  # an FP8 cache, widened to the 16-bit dtype on chip
    fp8_scores = q_scale_ref is not None  # queries in FP8; the keys read as they landed, only values widened
    n_wg = config.num_compute_wgs
    pages = config.pages_per_stage
    stages = config.num_stages
    # The rings the compute warpgroups read: the TMA ring, or over an FP8 cache the widened ring.
    operand_stages = config.num_widened_stages if widen else stages
    widen_keys = widen and not fp8_scores
    key_stages = operand_stages if widen_keys else stages
    stage_keys = pages * block_size
    max_blocks = block_tables_ref.shape[1]
    num_tiles, num_kv_heads = sched_ref.shape[0], q_ref.shape[0]
    num_items = config.num_kv_splits * num_tiles * num_kv_heads

    if interpreted:  # the interpreter takes no layout hints
        iota = functools.partial(lax.broadcasted_iota, jnp.int32)
        wgmma_layout = lambda x: x
    else:
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)
        wgmma_layout = _wgmma_layout

    program = lax.axis_index("program")
    my_items = (num_items - program + num_programs - 1) // num_programs

    def item_at(j) -> _Item:
        """This program's ``j``-th item. Launch order: splits slowest, then each tile's kv heads together
        (or, longest first, each kv head's tiles last to first)."""
        index = program + j * num_programs
        split, rest = index // (num_tiles * num_kv_heads), index % (num_tiles * num_kv_heads)
        if config.longest_first:
            kv_head, tile = rest // num_tiles, num_tiles - 1 - rest % num_tiles
        else:
            tile, kv_head = rest // num_kv_heads, rest % num_kv_heads
        num_rows = sched_ref[tile, NUM_ROWS]
        kv_end = sched_ref[tile, KV_END]
        first_stage = sched_ref[tile, KV_START] // stage_keys
        end_stage = (kv_end + stage_keys - 1) // stage_keys
        per_split = (end_stage - first_stage + config.num_kv_splits - 1) // config.num_kv_splits
        lo = jnp.minimum(first_stage + split * per_split, end_stage)
        hi = jnp.minimum(lo + per_split, end_stage)
        first_pos = sched_ref[tile, Q_POS0] + sched_ref[tile, ROW_OFFSET] // group
        full_hi = jnp.clip((first_pos + 1) // stage_keys, lo, hi)
        full_lo = lo
        if sliding_window:
            full_lo = jnp.clip((kv_end - sliding_window + stage_keys - 1) // stage_keys, lo, full_hi)
        num_steps = jnp.where(num_rows > 0, hi - lo, 0)
        return _Item(split, tile, kv_head, sched_ref[tile, REQ], num_rows, lo, hi, num_steps, full_lo, full_hi)

    def scoped(
        q_smem,
        out_smem,
        scale_smem,
        lse_smem,
        k_smem,
        v_smem,
        k_wide,
        v_wide,
        q_bar,
        k_bar,
        v_bar,
        k_wide_bar,
        v_wide_bar,
        k_free,
        v_free,
        turn,
    ):
        wg = lax.axis_index("wg")
        out_smem = q_smem if out_smem is None else out_smem  # 16-bit queries: the output takes their place
        # Each operand stage's keys and values and their "ready" barriers; ``k_free`` / ``v_free`` release them.
        k_ops, k_ready = (k_wide, k_wide_bar) if widen_keys else (k_smem, k_bar)
        v_ops, v_ready = (v_wide, v_wide_bar) if widen else (v_smem, v_bar)

        def rendezvous():
            """Both compute warpgroups meet; offset by one meeting, they alternate."""
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < n_wg)
        def _compute():
            if config.compute_registers:
                plgpu.set_max_registers(config.compute_registers, action="increase")
            last_granule = q_ref.shape[1] // GRANULE_ROWS - 1

            def run_item(j, base):
                """Item ``j``, whose first stage is the program's ``base``-th through the ring."""
                item = item_at(j)
                tile = item.tile
                # This warpgroup's granules of the tile: the first, and how many hold its rows.
                granule0 = sched_ref[tile, GRANULE0] + wg * GRANULES_PER_WG
                wg_rows = jnp.clip(item.num_rows - wg * ROWS_PER_WG, 0, ROWS_PER_WG)
                num_granules = (wg_rows + GRANULE_ROWS - 1) // GRANULE_ROWS
                for i in range(GRANULES_PER_WG):
                    src = jnp.clip(granule0 + jnp.minimum(i, num_granules - 1), 0, last_granule)
                    for ref, smem in ((q_ref, q_smem), (q_scale_ref, scale_smem)) if fp8_scores else ((q_ref, q_smem),):
                        plgpu.copy_gmem_to_smem(
                            ref.at[item.kv_head, pl.ds(src * GRANULE_ROWS, GRANULE_ROWS)],
                            smem.at[wg, pl.ds(i * GRANULE_ROWS, GRANULE_ROWS)],
                            q_bar.at[wg],
                        )
                row_max = wgmma_layout(jnp.full((ROWS_PER_WG,), MASKED, jnp.float32))
                row_sum = wgmma_layout(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32))
                acc = wgmma_layout(jnp.zeros((ROWS_PER_WG, head_dim), jnp.float32))
                plgpu.barrier_wait(q_bar.at[wg])
                row_scale = _row_vector(scale_smem.at[wg], interpreted) if fp8_scores else None

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
                    acc, row_max, row_sum = carry
                    k_slot = lax.rem(base + stage - item.lo, key_stages)
                    slot = lax.rem(base + stage - item.lo, operand_stages)
                    plgpu.barrier_wait(k_ready.at[k_slot])
                    s = _scores(q_smem.at[wg], k_ops.at[k_slot], interpreted, rendezvous if config.pingpong else None)
                    plgpu.barrier_arrive(k_free.at[k_slot])
                    if row_scale is not None:
                        s = s * lax.broadcast_in_dim(row_scale, s.shape, [0])
                    if soft_cap:
                        s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2_E)
                    else:
                        s = s * (sm_scale * LOG2_E)
                    if masked:
                        s = jnp.where(visible(stage), s, MASKED)
                    row_max_new = jnp.maximum(row_max, s.max(axis=1))
                    alpha = jnp.exp2(row_max - row_max_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(row_max_new, s.shape, [0]))
                    row_sum = row_sum * alpha + p.sum(axis=1)
                    if config.pingpong:  # softmax done; P V waits for the tensor cores' turn
                        plgpu.barrier_arrive(turn)
                        plgpu.barrier_wait(v_ready.at[slot])
                        plgpu.barrier_wait(turn)
                    else:
                        plgpu.barrier_wait(v_ready.at[slot])
                    acc = _accumulate_values(
                        acc, alpha, p.astype(dtype), v_ops.at[slot], config.accumulate_in_place, interpreted
                    )
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, row_max_new, row_sum

                carry = (acc, row_max, row_sum)
                end = item.lo + item.num_steps
                bounds = (item.lo, jnp.minimum(item.full_lo, end), jnp.minimum(item.full_hi, end), end)
                if config.pingpong:
                    pl.when(wg == 1)(rendezvous)  # warpgroup 0 goes first
                for (a, b), masked in zip(zip(bounds[:-1], bounds[1:]), (True, False, True)):
                    carry = lax.fori_loop(a, b, functools.partial(step, masked=masked), carry)
                if config.pingpong:
                    pl.when(wg == 0)(rendezvous)  # and meets warpgroup 1's last turn
                acc, row_max, row_sum = carry
                row_sum_safe = jnp.maximum(row_sum, 1e-30)
                out_smem.at[wg][...] = (acc / lax.broadcast_in_dim(row_sum_safe, acc.shape, [0])).astype(dtype)
                if lse_smem is not None:
                    lse_smem.at[wg][...] = row_max + jnp.log2(row_sum_safe)
                plgpu.commit_smem()
                for i in range(GRANULES_PER_WG):

                    @pl.when(i < num_granules)
                    def _write_back(i=i):
                        rows = pl.ds(i * GRANULE_ROWS, GRANULE_ROWS)
                        out_rows = pl.ds((granule0 + i) * GRANULE_ROWS, GRANULE_ROWS)
                        plgpu.copy_smem_to_gmem(out_smem.at[wg, rows], out_ref.at[item.split, item.kv_head, out_rows])
                        if lse_smem is not None:
                            plgpu.copy_smem_to_gmem(
                                lse_smem.at[wg, rows], lse_ref.at[item.split, item.kv_head, out_rows]
                            )

                plgpu.wait_smem_to_gmem(0)  # the next item's queries overwrite this output's rows
                return base + item.num_steps

            lax.fori_loop(0, my_items, run_item, jnp.int32(0))

        # What the copy warpgroups move: each stream's cache, FP8 (or only) ring, landed barriers, widened ring
        # and ready barriers (None where the stream is read as it landed), release barriers and their number.
        streams = (
            _Stream(k_ref, k_smem, k_bar, k_wide, k_wide_bar, k_free, key_stages),
            _Stream(v_ref, v_smem, v_bar, v_wide, v_wide_bar, v_free, operand_stages),
        )

        def _copy(owned: tuple[_Stream, ...]):
            """Copy (and over an FP8 cache widen) the ``owned`` streams' stages, item after item through the
            ring, so that the next item's first stages arrive while the compute warpgroups finish this one."""
            widened = [stream for stream in owned if stream.wide is not None]
            plain = [stream for stream in owned if stream.wide is None]
            if config.compute_registers:
                plgpu.set_max_registers(WIDENING_COPY_REGISTERS if widened else COPY_REGISTERS, action="decrease")

            def widen_step(h):
                """Widen the program's ``h``-th stage into the 16-bit ring once its slot there is free."""
                slot, wide_slot = lax.rem(h, stages), lax.rem(h, operand_stages)
                for stream in widened:
                    pl.when(h >= operand_stages)(lambda free=stream.free: plgpu.barrier_wait(free.at[wide_slot]))
                    plgpu.barrier_wait(stream.landed.at[slot])
                    _widen_stage(stream.ring.at[slot], stream.wide.at[wide_slot], interpreted)
                    plgpu.barrier_arrive(stream.ready.at[wide_slot])

            def run_item(j, base):
                item = item_at(j)

                def step(i, g):
                    """Stage ``i`` of the item, the program's ``g``-th: into the ring once its slot is free."""
                    # The block-table reads overlap the wait for the slot.
                    ids = [
                        jnp.maximum(
                            block_tables_ref[item.req, jnp.minimum((item.lo + i) * pages + p, max_blocks - 1)], 0
                        )
                        for p in range(pages)
                    ]
                    slot = lax.rem(g, stages)
                    if widened:  # a widened stream's FP8 slot frees once its stage is widened
                        pl.when(g >= stages)(lambda: widen_step(g - stages))
                    if plain:  # a plain stream's once the compute warpgroups release it

                        @pl.when(g >= stages)
                        def _wait_free():
                            for stream in plain:
                                plgpu.barrier_wait(stream.free.at[slot])

                    for stream in owned:
                        for p, page in enumerate(ids):
                            src, dst = stream.cache.at[page, :, item.kv_head], pl.ds(p * block_size, block_size)
                            plgpu.copy_gmem_to_smem(src, stream.ring.at[slot, dst], stream.landed.at[slot])
                    return g + 1

                return lax.fori_loop(0, item.num_steps, step, base)

            total = lax.fori_loop(0, my_items, run_item, jnp.int32(0))
            if widened:
                pl.loop(jnp.maximum(total - stages, 0), total)(widen_step)

            # Observe the last releases too, so every barrier phase is waited on once.
            for stream in owned:

                @pl.loop(jnp.maximum(total - stream.num_free, 0), total)
                def _drain(g, stream=stream):
                    plgpu.barrier_wait(stream.free.at[lax.rem(g, stream.num_free)])

        if widen and config.num_widening_wgs == 2:  # one warpgroup a stream: K and V widen side by side
            for j, stream in enumerate(streams):
                pl.when(wg == n_wg + j)(lambda stream=stream: _copy((stream,)))
        else:
            pl.when(wg == n_wg)(lambda: _copy(streams))

    tiled = _smem_transforms(dtype, head_dim)
    ring_tiled = _smem_transforms(k_ref.dtype, head_dim)
    wide = plgpu.SMEM((operand_stages, stage_keys, head_dim), dtype, transforms=tiled) if widen else None
    wide_bar = plgpu.Barrier(num_arrivals=1, num_barriers=operand_stages) if widen else None
    rows = (n_wg, ROWS_PER_WG)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((*rows, head_dim), q_ref.dtype, transforms=_smem_transforms(q_ref.dtype, head_dim)),
        plgpu.SMEM((*rows, head_dim), dtype, transforms=tiled) if fp8_scores else None,
        plgpu.SMEM((*rows, SCALE_LANES), jnp.float32) if fp8_scores else None,
        plgpu.SMEM(rows, jnp.float32) if lse_ref is not None else None,
        plgpu.SMEM((stages, stage_keys, head_dim), k_ref.dtype, transforms=ring_tiled),
        plgpu.SMEM((stages, stage_keys, head_dim), v_ref.dtype, transforms=ring_tiled),
        wide if widen_keys else None,
        wide,
        plgpu.Barrier(num_arrivals=GRANULES_PER_WG * (2 if fp8_scores else 1), num_barriers=n_wg),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        wide_bar if widen_keys else None,
        wide_bar,
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=key_stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=operand_stages),
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

    return pl.run_scoped(qk, plgpu.WGMMAAccumulatorRef((q_smem.shape[0], k_smem.shape[0]), jnp.float32))


def _accumulate_values(
    acc: Float[Array, "rows head_dim"],
    alpha: Float[Array, " rows"],
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
        # run_state returns the ref's final value, an array; jax annotates it as returning its argument's type.
        return pl.run_state(pv)(plgpu.WGMMAAccumulatorRef.init(acc * scale))  # pyright: ignore[reportReturnType]

    def fresh(acc_ref):
        pv(acc_ref)
        return acc_ref[...]

    pv_out = pl.run_scoped(fresh, plgpu.WGMMAAccumulatorRef((p.shape[0], v_smem.shape[1]), jnp.float32))
    return acc * scale + pv_out


def _widen_stage(narrow_smem, wide_smem, interpreted: bool) -> None:
    """One stage of the FP8 ring widened into the 16-bit ring wgmma reads, made visible to the tensor cores.

    ``WIDEN_ROWS`` keys at a time, loaded in the 8-bit wgmma layout: four FP8 values (32 bits) a
    shared-memory load.
    """
    for start in range(0, narrow_smem.shape[0], WIDEN_ROWS):
        rows = pl.ds(start, min(WIDEN_ROWS, narrow_smem.shape[0] - start))
        if interpreted:  # the interpreter takes no layout hints
            narrow = narrow_smem[rows]
        else:
            narrow = plgpu.load(narrow_smem.at[rows], (), layout=plgpu.Layout.WGMMA_8BIT)
        wide_smem[rows] = narrow.astype(wide_smem.dtype)
    plgpu.commit_smem()


def _row_vector(smem, interpreted: bool) -> Float[Array, " rows"]:
    """One value a query row from its ``SCALE_LANES`` copies in shared memory, in the layout of wgmma
    accumulators' rows."""
    tile = smem[...] if interpreted else plgpu.load(smem, (), layout=plgpu.Layout.WGMMA)
    return tile.max(axis=1)


def _wgmma_layout(x: Array) -> Array:
    """Pin a row vector (or a row-major tile) to the layout of wgmma accumulators' rows."""
    layout = plgpu.Layout.WGMMA.reduce(1) if x.ndim == 1 else plgpu.Layout.WGMMA
    return plgpu.layout_cast(x, layout)


def _smem_transforms(dtype, head_dim: int) -> tuple:
    """Swizzled tiles of 8 rows, 128 bytes wide where a row holds that many (an FP8 row of 64 holds 64):
    the shared-memory layout wgmma and TMA want."""
    swizzle = min(128, head_dim * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def launch_kernel(
    schedule_fields: Int[Array, "num_tiles 8"],
    block_tables: Int[Array, "num_reqs max_blocks_per_req"],
    q_packed: Float[Array, "num_kv_heads packed_rows head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    v_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    *,
    config: KernelConfig,
    group: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    q_scales: Float[Array, "num_kv_heads packed_rows scale_lanes"] | None = None,
    out_dtype=None,
    interpret=None,
) -> list[Array]:
    """The kernel alone: packed partial outputs ``[num_kv_splits, num_kv_heads, packed_rows, head_dim]``
    in ``out_dtype`` (default q's) and, with splits, their log-sum-exps ``[num_kv_splits, num_kv_heads,
    packed_rows]`` (log2 domain). ``q_scales``: FP8 queries' scales, ``SCALE_LANES`` copies a row
    (``config.fp8_scores``)."""
    num_kv_heads, out_rows, head_dim = q_packed.shape
    num_tiles = schedule_fields.shape[0]
    out_dtype = jnp.dtype(out_dtype or q_packed.dtype)
    widen = k_cache.dtype != out_dtype
    splits = config.num_kv_splits
    out_type = [jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows, head_dim), out_dtype)]
    if splits > 1:
        out_type.append(jax.ShapeDtypeStruct((splits, num_kv_heads, out_rows), jnp.float32))
    num_items = splits * num_tiles * num_kv_heads
    num_programs = min(config.num_programs or num_items, num_items)
    body = functools.partial(
        _kernel_body,
        config=config,
        num_programs=num_programs,
        group=group,
        block_size=k_cache.shape[1],
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpreted=interpret is not None,
    )

    def entry(sched_ref, tables_ref, q_ref, *refs):
        q_scale_ref, refs = (refs[0], refs[1:]) if q_scales is not None else (None, refs)
        k_ref, v_ref, out_ref, *lse_ref = refs
        body(sched_ref, tables_ref, q_ref, q_scale_ref, k_ref, v_ref, out_ref, lse_ref[0] if lse_ref else None)

    inputs = (schedule_fields, block_tables, q_packed, *([] if q_scales is None else [q_scales]), k_cache, v_cache)

    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(num_programs,),
        grid_names=("program",),
        num_threads=config.num_compute_wgs + (config.num_widening_wgs if widen else 1),
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*inputs)
