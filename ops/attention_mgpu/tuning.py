"""The kernel's static launch parameters and the table that picks them from a call's shapes.

:class:`KernelConfig` holds stage and ring sizes, compute and copy warpgroups, KV splits and
schedule switches; :func:`choose_config` is the tuning table, :func:`choose_splits` its
model of how many ways to split each tile's KV range, and :func:`kernel_supports` the
cases the kernel takes at all. The sweeps behind the table's choices are in
``benchmarks/attention_step.py --sweep`` and ``benchmarks/decisions/kv_splits.md``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.attention_mgpu.schedule import num_tiles_bound

HOPPER_SMS = 132
"""Streaming multiprocessors of an H100 SXM or an H200: the table's default for wave and persistent-grid sizes."""
ROWS_PER_WG = 64
"""Query rows per compute warpgroup: the M of one wgmma."""
SCALE_LANES = 8
"""Copies of each FP8 query row's scale side by side (``fp8_scores``): a granule's scales then make a copy of
256 bytes (a warpgroup's copies move a multiple of 128), read as a ``[64, 8]`` tile in the wgmma layout."""

SUPPORTED_HEAD_DIMS = (64, 128, 256)
QUERY_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Queries (and the kernel's matmuls) in 16 bits; float32 would run wgmma in tf32."""
FP8_CACHE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
"""FP8 caches the kernel reads, its copy warpgroup converting each stage to float16 on chip."""
SHARED_MEMORY_BYTES = (227 - 3) * 1024
"""Shared memory for a program's queries, ring and log-sum-exps: Hopper's 227 KiB a block, less
3 KiB for the barriers and scratch the compiler allocates beside them."""
PREFILL_COMPUTE_REGISTERS = 232
"""Registers per thread for each of two prefill compute warpgroups (the copy warpgroup drops to
``kernel.COPY_REGISTERS``, 40: 2 x 232 + 40 = 3 x 168, a 384-thread program's share of the register file)."""
FP8_PREFILL_COMPUTE_REGISTERS = 208
"""The same over an FP8 cache, whose copy warpgroup keeps ``kernel.WIDENING_COPY_REGISTERS`` (88) to widen
stages: 2 x 208 + 88 = 3 x 168."""
MIN_STAGES_PER_SPLIT = 2
"""A split shorter than this costs more in per-program setup and combining than it gains
(``benchmarks/decisions/kv_splits.md``)."""
PROGRAM_SETUP_STAGES = 2.0
"""A program's fixed cost (queries in, pipeline fill, output out), in stages of streaming time
(fitted: ``benchmarks/decisions/kv_splits.md``)."""
SPLIT_COMBINE_STAGES = 0.35
"""What each further split adds to the combine, in stages of streaming time
(fitted: ``benchmarks/decisions/kv_splits.md``)."""


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
    num_widened_stages: int = 2
    """Over an FP8 cache, stages of the 16-bit ring the copy warpgroup widens the FP8 ring into
    (the compute warpgroups read that ring); unused over a 16-bit cache."""
    num_programs: int | None = None
    """Programs launched, each taking the items (split, tile, kv head) ``p, p + num_programs, ...`` one
    after another through one ring, so that an item's first stages arrive while the one before finishes
    (persistent programs); None launches one program an item."""
    num_widening_wgs: int = 1
    """Over an FP8 cache, copy warpgroups that widen: 1 moves and widens keys and values, 2 split them
    (keys in one, values in the other) so that the two widenings run side by side; unused over a
    16-bit cache."""
    fp8_scores: bool = False
    """Over an e4m3 cache, ``Q K^T`` in FP8 on the tensor cores: the queries come in e4m3 with a power-of-two
    scale a row (``wrapper.fp8_queries``), the keys straight from the FP8 ring (no widening), the scores
    multiplied back by each row's scale; only the values are widened. Unused over other caches (wgmma takes
    no e4m3 x e5m2 product)."""
    compute_registers: int | None = None
    """Registers per thread the compute warpgroups take from the copy warpgroup
    (``setmaxnreg``; the copy warpgroup drops to ``kernel.COPY_REGISTERS``); None leaves
    the compiler's even split."""
    accumulate_in_place: bool = False
    """Rescale the output accumulator and let ``P V`` accumulate into it (one
    accumulator live instead of two)."""
    pingpong: bool = False
    """With two compute warpgroups, take turns on the tensor cores: one runs its
    softmax while the other's matmuls run."""
    longest_first: bool = False
    """Launch each kv head's tiles last to first, one kv head after another (the default
    launches each tile's kv heads together, first tile first): a request's later tiles
    see more keys (causal), so the last wave holds short programs instead of the longest."""

    def __post_init__(self):
        if self.pingpong and self.num_compute_wgs != 2:
            raise ValueError(f"pingpong needs two compute warpgroups, got {self.num_compute_wgs}")
        if self.num_widening_wgs not in (1, 2):
            raise ValueError(f"num_widening_wgs is 1 or 2, got {self.num_widening_wgs}")

    @property
    def tile_rows(self) -> int:
        """Query rows per tile: 64 per compute warpgroup."""
        return ROWS_PER_WG * self.num_compute_wgs


def choose_splits(programs: int, kv_stages: int, num_sms: int) -> int:
    """KV splits that minimise the modelled time of a grid of ``programs`` (tiles x kv heads)
    streaming ``kv_stages`` each: waves of one program per SM, each wave as long as its
    longest program (a split streams whole stages: the ceiling of its share) plus its fixed
    cost, plus the combine. A grid that already fills the SMs once is not split: it reads
    its KV at the copy rate unsplit. The sweeps it reproduces: ``benchmarks/decisions/kv_splits.md``.
    """
    if programs >= num_sms:
        return 1
    most = max(kv_stages // MIN_STAGES_PER_SPLIT, 1)

    def modelled_time(splits: int) -> float:
        waves = -(-programs * splits // num_sms)
        return waves * (-(-kv_stages // splits) + PROGRAM_SETUP_STAGES) + SPLIT_COMBINE_STAGES * splits

    return min(range(1, most + 1), key=modelled_time)


def program_shared_memory(
    config: KernelConfig, head_dim: int, block_size: int, itemsize: int, cache_itemsize: int | None = None
) -> int:
    """Shared-memory bytes of one program's queries, K/V ring, (when split) log-sum-exps and
    (over an FP8 cache, ``cache_itemsize`` 1) the widened 16-bit ring: the part
    ``SHARED_MEMORY_BYTES`` bounds. With ``fp8_scores`` FP8 queries and their scales come beside the
    16-bit output tile."""
    cache_itemsize = cache_itemsize or itemsize
    widen = cache_itemsize < itemsize
    fp8_scores = widen and config.fp8_scores
    stage_keys = config.pages_per_stage * block_size
    rows = config.num_compute_wgs * ROWS_PER_WG
    queries = rows * head_dim * itemsize
    if fp8_scores:  # FP8 queries and their scales beside the 16-bit output
        queries += rows * (head_dim * cache_itemsize + SCALE_LANES * 4)
    ring = config.num_stages * stage_keys * 2 * head_dim * cache_itemsize
    lse = rows * 4 if config.num_kv_splits > 1 else 0
    # Both streams widened (with fp8_scores too: an e5m2 cache widens its keys; only e4m3's are read as they land).
    widened = config.num_widened_stages * stage_keys * 2 * head_dim * itemsize if widen else 0
    return queries + ring + lse + widened


def kernel_supports(dtype, head_dim: int, block_size: int, cache_dtype=None) -> bool:
    """Whether the kernel runs this case on a GPU: 16-bit queries over a cache of their dtype or
    of FP8 (``CACHE_DTYPES``), its head dims, pages that tile a stage of a multiple of 64 keys
    (8-row-aligned, and either dividing 64 or a multiple of it), and room in shared memory for
    the smallest split prefill program (two stages of one such stage each)."""
    dtype = jnp.dtype(dtype)
    cache_dtype = dtype if cache_dtype is None else jnp.dtype(cache_dtype)
    smallest_prefill = KernelConfig(
        pages_per_stage=max(64 // block_size, 1), num_stages=2, num_compute_wgs=2, num_kv_splits=2
    )
    memory = program_shared_memory(smallest_prefill, head_dim, block_size, 2, cache_dtype.itemsize)
    return (
        dtype in QUERY_DTYPES
        and (cache_dtype == dtype or cache_dtype in FP8_CACHE_DTYPES)
        and head_dim in SUPPORTED_HEAD_DIMS
        and block_size % 8 == 0
        and (64 % block_size == 0 or block_size % 64 == 0)
        and memory <= SHARED_MEMORY_BYTES
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
    num_sms: int = HOPPER_SMS,
    cache_itemsize: int | None = None,
) -> KernelConfig:
    """The tuning table: static shapes -> launch parameters.

    Decode-like batches (at most 64 query rows per request) use one compute
    warpgroup, 64-key stages in a ring of about 96 KiB (sized for two programs a
    SM, though at 153 registers a thread one program fills an SM's register file)
    and in-place ``P V`` accumulation; KV splits by :func:`choose_splits`, over the
    stages of the longest possible request (the block table's width). Over an FP8
    cache, one persistent program a SM (the next item's first stages stream while
    the last one's finish) and two widening warpgroups (keys and values widened side
    by side): together about a fifth less kernel time at 64 x 4k and 256 x 1k on an
    H100 than one program an item with one widening warpgroup.

    Prefills use two compute warpgroups in ping-pong with the register split and
    in-place accumulation, tiles launched longest first, and 128-key stages in as many
    as three ring stages as shared memory holds beside the queries.

    Each of these switches was the faster side of its sweep on the GPU
    (``benchmarks/history/RESULTS.md``: "The tuning table's neighbours" for decode,
    "Prefill schedule swept by device time" for prefill).

    Over an FP8 cache (``cache_itemsize`` 1) the ring holds FP8 stages beside two stages
    widened to 16 bits, taken from the same budget; stages stay at 64 keys, and prefill's
    compute warpgroups leave the copy warpgroup the registers it widens with.
    """
    cache_itemsize = cache_itemsize or itemsize
    decode_like = num_tokens * group <= num_reqs * ROWS_PER_WG
    n_wg = 1 if decode_like else 2
    key_bytes = 2 * head_dim * cache_itemsize  # one key's K and V in the ring
    query_bytes = n_wg * ROWS_PER_WG * head_dim * itemsize
    widened_bytes = KernelConfig.num_widened_stages * 64 * 2 * head_dim * itemsize if cache_itemsize < itemsize else 0
    ring_bytes = (96 * 1024 if decode_like else SHARED_MEMORY_BYTES - query_bytes) - widened_bytes
    # Keys per stage: a multiple of 64 (the K of one 128-byte-swizzled bf16 wgmma), two stages in the ring.
    widest = 64 if decode_like or widened_bytes else 128
    stage_keys = max(min(widest, ring_bytes // (2 * key_bytes)) // 64 * 64, 64)
    pages = max(stage_keys // block_size, 1)  # pages larger than a stage make a stage of one page
    stage_bytes = pages * block_size * key_bytes
    tiles = num_tiles_bound(num_tokens, num_reqs, group, ROWS_PER_WG * n_wg)
    kv_stages = -(-max_blocks_per_req // pages)
    if decode_like:
        # Work in about one tile per request; the rest of the bound is padding.
        splits = choose_splits(min(tiles, num_reqs) * num_kv_heads, kv_stages, num_sms)
        return KernelConfig(
            pages_per_stage=pages,
            num_stages=max(2, min(4, ring_bytes // stage_bytes)),
            num_compute_wgs=1,
            num_kv_splits=splits,
            accumulate_in_place=True,
            num_programs=num_sms if widened_bytes else None,
            num_widening_wgs=2 if widened_bytes else 1,
        )
    splits = choose_splits(tiles * num_kv_heads, kv_stages, num_sms)
    two_stages = KernelConfig(
        pages_per_stage=pages,
        num_stages=2,
        num_compute_wgs=2,
        num_kv_splits=splits,
        compute_registers=FP8_PREFILL_COMPUTE_REGISTERS if widened_bytes else PREFILL_COMPUTE_REGISTERS,
        accumulate_in_place=True,
        pingpong=True,
        longest_first=True,
    )
    three_stages = dataclasses.replace(two_stages, num_stages=3)
    fits = program_shared_memory(three_stages, head_dim, block_size, itemsize, cache_itemsize) <= SHARED_MEMORY_BYTES
    return three_stages if fits else two_stages


def config_for(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    metadata: AttentionMetadata,
) -> KernelConfig:
    """The tuning table's choice for this call's static shapes."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs, max_blocks_per_req = metadata.block_tables.shape
    return choose_config(
        num_tokens,
        num_reqs,
        num_q_heads // num_kv_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_blocks_per_req,
        q.dtype.itemsize,
        num_sms=device_sms(),
        cache_itemsize=k_cache.dtype.itemsize,
    )


def device_sms() -> int:
    """The default device's streaming multiprocessors (``HOPPER_SMS`` where the backend does not say, as on
    the CPU): an H100 PCIe has 114, and a persistent grid of 132 there would run in two waves."""
    return getattr(jax.devices()[0], "core_count", None) or HOPPER_SMS
