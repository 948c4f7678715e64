"""The Mosaic GPU ragged paged attention kernel against the pure-JAX reference.

On the CPU the kernel runs through the Mosaic GPU interpreter (small shapes: it
simulates every warpgroup, barrier and TMA copy); the ``gpu`` tests run the
compiled kernel at real sizes. Inputs are random mixed batches over shuffled
block tables with padded tokens and requests (``test_attention_reference``).
"""

import dataclasses
import functools
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_reference import LONG, MIXED, ODD, Case, _check, _make_inputs

from jaxrunner.compat import mosaic_gpu_interpreter
from jaxrunner.ops import AttentionMetadata, ragged_paged_attention
from jaxrunner.ops.attention_mgpu import (
    FP8_PREFILL_COMPUTE_REGISTERS,
    SHARED_MEMORY_BYTES,
    KernelConfig,
    choose_config,
    choose_splits,
    compute_dtype,
    config_for,
    fp8_queries,
    kernel_supports,
    num_granules_bound,
    num_tiles_bound,
    program_shared_memory,
    ragged_paged_attention_mgpu,
    tile_schedule,
)


class _Shape(TypedDict):
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


SMALL = _Shape(num_q_heads=4, num_kv_heads=2, head_dim=64)

# A sliding window over a bucket padded far past its rows (many more tiles than rows).
PADDED_WINDOW = Case(reqs=((0, 20), (40, 3)), sliding_window=8, pad_tokens=300, dtype=jnp.bfloat16, **SMALL)


def _kernel_vs_reference(
    case: Case, seed: int, config: KernelConfig | None, tol: float, interpret, cache_dtype=None, switches=None
) -> None:
    """The kernel against the reference on one random case; with ``cache_dtype`` (FP8) the caches are
    quantized to it, and the reference reads the same values widened to q's dtype (exactly), and with
    ``config.fp8_scores`` the queries the kernel rounds to FP8 (exact in q's dtype too). ``switches``:
    fields of the table's config to change (with ``config`` None)."""
    q, k_cache, v_cache, metadata = _make_inputs(case, seed)
    if switches:
        config = dataclasses.replace(config_for(q, k_cache.astype(cache_dtype or q.dtype), metadata), **switches)
    q_read = q
    if cache_dtype == jnp.float8_e4m3fn and config is not None and config.fp8_scores:
        q8, scale = fp8_queries(q.astype(compute_dtype(q.dtype, cache_dtype)))
        q_read = (q8.astype(jnp.float32) * scale[..., None]).astype(q.dtype)
    kwargs = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    kernel = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, config=config, interpret=interpret, **kwargs))
    reference = jax.jit(lambda *a: ragged_paged_attention(*a, impl="reference", **kwargs))
    if cache_dtype is not None:
        k_cache, v_cache = (c.astype(cache_dtype) for c in (k_cache, v_cache))
        got = np.asarray(kernel(q, k_cache, v_cache, metadata), np.float64)
        want = np.asarray(reference(q_read, k_cache.astype(q.dtype), v_cache.astype(q.dtype), metadata), np.float64)
    else:
        got = np.asarray(kernel(q, k_cache, v_cache, metadata), np.float64)
        want = np.asarray(reference(q, k_cache, v_cache, metadata), np.float64)
    _check(case, got, want, tol)


@pytest.mark.parametrize(
    "case, config, tol",
    [
        # float32: 4-page stages over a 2-deep ring (refills), one compute warpgroup, three persistent
        # programs (the interpreter's cost is per program).
        (Case(reqs=MIXED, **SMALL), KernelConfig(4, 2, 1, 1, num_programs=3), 1e-5),
        # Odd lengths (1, 15, 17, block +- 1: a decode, a chunk after context), one-page stages, two
        # compute warpgroups taking registers from the copy warpgroup, tiles launched last to first,
        # one program an item (as the prefill table launches them; four requests: each program costs).
        (
            Case(reqs=(ODD[0], ODD[1], ODD[3], ODD[7]), **SMALL),
            KernelConfig(1, 2, 2, 1, compute_registers=232, longest_first=True),
            1e-5,
        ),
        # bf16, KV split in three (partial outputs combined), sliding window and soft cap, in two
        # persistent programs (items of different splits and lengths one after another through one ring).
        (
            Case(reqs=LONG[:2], sliding_window=23, soft_cap=2.0, dtype=jnp.bfloat16, **SMALL),
            KernelConfig(2, 3, 1, 3, num_programs=2),
            1e-2,
        ),
        # A sliding window over a bucket with many more tiles than rows (a padded step), in two persistent
        # programs: the empty tiles far past the last row must span no stages (they once made the compute
        # warpgroup wait forever for stages never copied).
        (PADDED_WINDOW, KernelConfig(4, 2, 1, 1, num_programs=2, accumulate_in_place=True), 1e-2),
    ],
    ids=["f32-mixed", "f32-odd-2wg", "bf16-split-window-cap", "bf16-window-empty-tiles"],
)
# No ping-pong case: one CI run of it under the Mosaic GPU interpreter hung (it passes elsewhere). The GPU tests
# run it through the table's prefill configs, and the CUDA lowering test below covers it.
def test_interpreted_kernel_matches_reference(case, config, tol):
    _kernel_vs_reference(case, seed=3, config=config, tol=tol, interpret=mosaic_gpu_interpreter())


@pytest.mark.parametrize(
    "case, config, cache_dtype",
    [
        # Decode-like: one compute warpgroup, 4-page stages over a 2-deep ring (refills) widened into
        # a 2-deep ring by two copy warpgroups (keys, values), split in two, three persistent programs.
        (
            Case(reqs=MIXED, dtype=jnp.bfloat16, **SMALL),
            KernelConfig(4, 2, 1, 2, num_programs=3, num_widening_wgs=2, accumulate_in_place=True),
            jnp.float8_e4m3fn,
        ),
        # Odd lengths, one-page stages, two compute warpgroups reading a widened ring deeper than
        # the FP8 ring, and a widened ring of one stage (persistent programs: the interpreter's cost
        # is per program, and the rings then carry over from one item to the next).
        (
            Case(reqs=ODD, dtype=jnp.bfloat16, **SMALL),
            KernelConfig(1, 2, 2, 1, num_widened_stages=3, num_programs=2),
            jnp.float8_e5m2,
        ),
        (
            Case(reqs=ODD, dtype=jnp.bfloat16, **SMALL),
            KernelConfig(2, 3, 1, 1, num_widened_stages=1, num_programs=3),
            jnp.float8_e4m3fn,
        ),
        # Scores in FP8: queries in e4m3 with a scale a row, keys read from the FP8 ring as they landed (a
        # ring of 3 beside a widened value ring of 2), values widened by their own copy warpgroup, split in
        # two; then one copy warpgroup moving both (keys plain, values widened) for two compute warpgroups.
        (
            Case(reqs=MIXED, dtype=jnp.bfloat16, **SMALL),
            KernelConfig(2, 3, 1, 2, num_programs=3, num_widening_wgs=2, accumulate_in_place=True, fp8_scores=True),
            jnp.float8_e4m3fn,
        ),
        (
            Case(reqs=ODD, dtype=jnp.bfloat16, **SMALL),
            KernelConfig(1, 2, 2, 1, num_widened_stages=3, num_programs=2, fp8_scores=True),
            jnp.float8_e4m3fn,
        ),
    ],
    ids=["e4m3-mixed-split", "e5m2-odd-2wg", "e4m3-odd-one-widened", "e4m3-fp8-scores", "e4m3-fp8-scores-2wg"],
)
def test_interpreted_kernel_over_fp8_cache_matches_reference(case, config, cache_dtype):
    """FP8 pages widened on chip give the reference's attention over the same values."""
    _kernel_vs_reference(
        case, seed=5, config=config, tol=1e-2, interpret=mosaic_gpu_interpreter(), cache_dtype=cache_dtype
    )


def test_tile_schedule_covers_every_row_once():
    """Each request's ``q_len * G`` rows land in its own tiles, in order, none dropped or shared."""
    case = Case(reqs=MIXED, num_q_heads=8, num_kv_heads=2)
    _, _, _, metadata = _make_inputs(case, seed=1)
    group, tile_rows = 4, 64
    num_tokens = sum(q for _, q in case.reqs) + case.pad_tokens
    num_tiles = num_tiles_bound(num_tokens, len(case.reqs) + case.pad_reqs, group, tile_rows)
    fields = np.asarray(tile_schedule(metadata, group, tile_rows, num_tiles, sliding_window=None).fields)
    qsl = np.asarray(metadata.query_start_loc)
    covered, next_granule = [], 0
    for req, q_row, num_rows, row_offset, q_pos0, kv_start, kv_end, granule0 in fields[fields[:, 2] > 0]:
        assert q_row == qsl[req] * group + row_offset
        assert kv_start == 0 and kv_end == q_pos0 + (row_offset + num_rows - 1) // group + 1
        assert granule0 == next_granule  # tiles' granules packed back to back, a short tile's rounded up
        next_granule += -(-num_rows // 8)
        covered.extend(range(q_row, q_row + num_rows))
    assert covered == list(range(qsl[len(case.reqs)] * group))
    assert next_granule <= num_granules_bound(num_tokens, len(case.reqs) + case.pad_reqs, group, tile_rows)


def test_tiles_without_rows_span_no_keys_under_a_sliding_window():
    """Empty tiles (a bucket padded past its requests) start and end at key 0, however far past the last
    row they fall; tiles with rows start ``sliding_window - 1`` keys before their first row."""
    case, group, tile_rows = PADDED_WINDOW, 2, 64
    _, _, _, metadata = _make_inputs(case, seed=1)
    window = case.sliding_window
    num_tokens = sum(q for _, q in case.reqs) + case.pad_tokens
    num_tiles = num_tiles_bound(num_tokens, len(case.reqs) + case.pad_reqs, group, tile_rows)
    fields = np.asarray(tile_schedule(metadata, group, tile_rows, num_tiles, sliding_window=window).fields)
    _, _, num_rows, row_offset, q_pos0, kv_start, kv_end, _ = fields.T
    empty = num_rows == 0
    assert empty.sum() > 4  # far enough past the last row for a window to start beyond key 0
    assert not kv_start[empty].any() and not kv_end[empty].any()
    first_pos = q_pos0 + row_offset // group
    np.testing.assert_array_equal(kv_start[~empty], np.maximum(first_pos[~empty] - window + 1, 0))


def test_kernel_is_lowered_once_per_shape():
    """A model calls the kernel once per layer; the program must hold one copy of it, called per layer."""
    case = Case(reqs=((3, 1), (0, 5)), **SMALL)
    q, k_cache, v_cache, metadata = _make_inputs(case, seed=0)
    interpret = mosaic_gpu_interpreter()

    def layers(x):
        for _ in range(4):
            x = ragged_paged_attention_mgpu(x, k_cache, v_cache, metadata, sm_scale=0.125, interpret=interpret)
        return x

    text = jax.jit(layers).lower(q).as_text()
    assert text.count("func.func private @ragged_paged_attention_mgpu(") == 1
    assert text.count("call @ragged_paged_attention_mgpu(") == 4


def test_config_table_splits_only_small_grids():
    decode_1 = choose_config(1, 1, 4, 8, 128, 16, 2048, 2)
    decode_64 = choose_config(64, 64, 4, 8, 128, 16, 256, 2)
    prefill = choose_config(8192, 1, 4, 8, 128, 16, 512, 2)
    assert decode_1.num_kv_splits > 1 and decode_1.num_compute_wgs == 1
    assert decode_64.num_kv_splits == 1 and decode_64.num_compute_wgs == 1
    assert prefill.num_kv_splits == 1 and prefill.num_compute_wgs == 2


def test_fp8_decode_takes_persistent_programs_and_two_widening_warpgroups():
    """The H100 sweep's choice for decode over an FP8 cache; a bf16 cache and FP8 prefills keep one program an
    item and one copy warpgroup."""
    fp8_decode = choose_config(64, 64, 4, 8, 128, 16, 256, 2, num_sms=132, cache_itemsize=1)
    assert fp8_decode.num_programs == 132 and fp8_decode.num_widening_wgs == 2
    bf16_decode = choose_config(64, 64, 4, 8, 128, 16, 256, 2, num_sms=132)
    fp8_prefill = choose_config(8192, 1, 4, 8, 128, 16, 512, 2, num_sms=132, cache_itemsize=1)
    for config in (bf16_decode, fp8_prefill):
        assert config.num_programs is None and config.num_widening_wgs == 1


def test_split_model_keeps_the_sweeps_optima_and_the_sms_busy():
    """The split model against the H100 sweep's fastest split counts (16 stages of 64 keys = 1k),
    and a grid of 9 requests at 4k (72 programs) is split rather than left on 72 of 132 SMs."""
    assert choose_splits(programs=128, kv_stages=16, num_sms=132) == 1  # 16 x 1k
    assert choose_splits(programs=8, kv_stages=16, num_sms=132) == 8  # 1 x 1k: two whole stages a split
    assert choose_splits(programs=72, kv_stages=64, num_sms=132) > 1
    assert choose_splits(programs=132, kv_stages=512, num_sms=132) == 1  # one full wave: never split
    assert choose_splits(programs=1, kv_stages=3, num_sms=132) == 1  # splits keep two stages each


def test_kernel_takes_only_the_cases_it_supports():
    assert kernel_supports(jnp.bfloat16, 128, 16) and kernel_supports(jnp.float16, 64, 128)
    assert not kernel_supports(jnp.float32, 128, 16)  # wgmma would run it in tf32
    assert not kernel_supports(jnp.bfloat16, 96, 16)
    assert not kernel_supports(jnp.bfloat16, 128, 48)  # a stage of 48 keys is no wgmma K
    assert not kernel_supports(jnp.bfloat16, 256, 128)  # two 128-key pages of D=256 and the queries: 320 KiB
    assert kernel_supports(jnp.bfloat16, 128, 16, jnp.float8_e4m3fn) and kernel_supports(
        jnp.float16, 64, 16, jnp.float8_e5m2
    )
    assert not kernel_supports(jnp.bfloat16, 128, 16, jnp.float16)  # a 16-bit cache is q's dtype
    assert not kernel_supports(jnp.bfloat16, 256, 16, jnp.float8_e4m3fn)  # the widened stages do not fit beside D=256


@pytest.mark.parametrize(
    "head_dim, block_size",
    [(d, b) for d in (64, 128, 256) for b in (8, 16, 32, 64, 128) if kernel_supports(jnp.bfloat16, d, b)],
)
def test_table_configs_fit_in_shared_memory(head_dim, block_size):
    """Queries, ring, (split) log-sum-exps and (FP8) widened stages of every config the table picks
    for a supported case."""
    max_blocks = 32768 // block_size
    cache_itemsizes = [2] + ([1] if kernel_supports(jnp.bfloat16, head_dim, block_size, jnp.float8_e4m3fn) else [])
    for cache_itemsize in cache_itemsizes:
        for num_tokens, num_reqs in [(1, 1), (64, 64), (256, 1), (8192, 1), (2048, 8)]:
            config = choose_config(
                num_tokens, num_reqs, 4, 8, head_dim, block_size, max_blocks, 2, cache_itemsize=cache_itemsize
            )
            used = program_shared_memory(config, head_dim, block_size, 2, cache_itemsize)
            assert used <= SHARED_MEMORY_BYTES, (num_tokens, num_reqs, cache_itemsize, config, used)


def _lower_for_cuda(
    num_tokens: int, num_reqs: int, max_blocks: int, head_dim: int, dtype, config: KernelConfig, cache_dtype=None
):
    """The kernel at 32 query / 8 KV heads lowered for CUDA: Mosaic GPU's own checks of shapes, copies, layouts."""
    spec = jax.ShapeDtypeStruct
    q = spec((num_tokens, 32, head_dim), dtype)
    cache = spec((4096, 16, 8, head_dim), cache_dtype or dtype)
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    metadata = jax.eval_shape(  # shapes only: AttentionMetadata's fields are arrays
        lambda: AttentionMetadata(zeros(num_reqs + 1), zeros(num_reqs), zeros(num_reqs, max_blocks), zeros(num_tokens))
    )
    kernel = functools.partial(ragged_paged_attention_mgpu, sm_scale=head_dim**-0.5, config=config)
    return jax.jit(kernel).trace(q, cache, cache, metadata).lower(lowering_platforms=("cuda",))


# The table's choice for decode (64 x 4k, 1 x 32k) and prefill (1 x 8k; 256 tokens, split: its log-sum-exps
# take shared memory too), and the switches the sweep tries.
LOWERED_CASES = {
    "decode-64": (64, 64, 256),
    "decode-1-split": (1, 1, 2048),
    "prefill": (8192, 1, 512),
    "prefill-split": (256, 1, 512),
}
SWITCHES = {
    "table": {},
    "registers+in_place": dict(compute_registers=232, accumulate_in_place=True),
    "pingpong": dict(pingpong=True, compute_registers=232, accumulate_in_place=True),
    "longest_first": dict(longest_first=True),
}


@pytest.mark.parametrize(
    "head_dim, dtype, cache_dtype",
    [
        (128, jnp.bfloat16, None),
        (64, jnp.float16, None),
        (256, jnp.bfloat16, None),
        (128, jnp.float16, jnp.float8_e4m3fn),
        (64, jnp.float16, jnp.float8_e5m2),
    ],
    ids=["bf16-128", "f16-64", "bf16-256", "fp8-128", "fp8-64"],
)
@pytest.mark.parametrize(
    "case, switches",
    # Ping-pong takes two compute warpgroups: prefill only.
    [(c, s) for c in sorted(LOWERED_CASES) for s in sorted(SWITCHES) if s != "pingpong" or c.startswith("prefill")],
)
def test_kernel_lowers_for_cuda_with_every_config_it_may_run(case, switches, head_dim, dtype, cache_dtype):
    num_tokens, num_reqs, max_blocks = LOWERED_CASES[case]
    itemsize = jnp.dtype(dtype).itemsize
    cache_itemsize = jnp.dtype(cache_dtype or dtype).itemsize
    config = choose_config(
        num_tokens, num_reqs, 4, 8, head_dim, 16, max_blocks, itemsize, cache_itemsize=cache_itemsize
    )
    config = dataclasses.replace(config, **SWITCHES[switches])
    if cache_dtype is not None and config.compute_registers:  # leave the widening copy warpgroup its registers
        config = dataclasses.replace(config, compute_registers=FP8_PREFILL_COMPUTE_REGISTERS)
    lowered = _lower_for_cuda(num_tokens, num_reqs, max_blocks, head_dim, dtype, config, cache_dtype)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", sorted(LOWERED_CASES))
def test_kernel_lowers_for_cuda_with_scores_in_fp8(case, head_dim):
    """``fp8_scores`` over an e4m3 cache: FP8 queries and scales copied in, ``Q K^T`` an FP8 wgmma on the keys'
    ring, values widened."""
    num_tokens, num_reqs, max_blocks = LOWERED_CASES[case]
    config = choose_config(num_tokens, num_reqs, 4, 8, head_dim, 16, max_blocks, 2, cache_itemsize=1)
    config = dataclasses.replace(config, fp8_scores=True)
    lowered = _lower_for_cuda(num_tokens, num_reqs, max_blocks, head_dim, jnp.float16, config, jnp.float8_e4m3fn)
    assert "mosaic_gpu" in lowered.as_text()


def test_unknown_impl_flag_is_refused(monkeypatch):
    case = Case(reqs=((0, 1),), **SMALL)
    q, k_cache, v_cache, metadata = _make_inputs(case, seed=0)
    monkeypatch.setenv("JAXRUNNER_ATTENTION_IMPL", "triton")
    with pytest.raises(ValueError, match="JAXRUNNER_ATTENTION_IMPL"):
        ragged_paged_attention(q, k_cache, v_cache, metadata, sm_scale=0.125)


# Real sizes on the H200: Llama-3-8B heads unless a case says otherwise.
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
GPU_CASES = {
    "decode-64x4k": Case(reqs=tuple([(4095, 1)] * 64), dtype=jnp.bfloat16, **LLAMA),
    "decode-1x32k-split": Case(reqs=((32767, 1),), dtype=jnp.bfloat16, **LLAMA),
    "mixed": Case(reqs=((0, 1024), (2048, 512), (1000, 1), (3000, 1), (17, 15)) + MIXED, dtype=jnp.bfloat16, **LLAMA),
    "odd-fp16": Case(reqs=ODD + LONG, dtype=jnp.float16, **LLAMA),
    "prefill-2k": Case(reqs=((0, 2048),), dtype=jnp.bfloat16, **LLAMA),
    "window-cap": Case(reqs=MIXED + LONG, sliding_window=33, soft_cap=30.0, dtype=jnp.bfloat16, **LLAMA),
    "head-dim-64": Case(reqs=MIXED, dtype=jnp.bfloat16, num_q_heads=16, num_kv_heads=2, head_dim=64),
    "head-dim-256": Case(reqs=MIXED, dtype=jnp.bfloat16, num_q_heads=8, num_kv_heads=4, head_dim=256),
    # The heads of the served families' benchmark shapes: Gemma-3-12B's sliding-window layers over short
    # prefills (a profile run's step) and a long request, Qwen3-30B-A3B's eight query heads a KV head.
    "gemma3-window": Case(
        reqs=((0, 32),) * 64 + ((3000, 8),),
        sliding_window=1024,
        dtype=jnp.bfloat16,
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=256,
    ),
    "qwen3-moe-decode-64x1k": Case(
        reqs=((1023, 1),) * 64, dtype=jnp.bfloat16, num_q_heads=32, num_kv_heads=4, head_dim=128
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_compiled_kernel_matches_reference(name):
    _kernel_vs_reference(GPU_CASES[name], seed=7, config=None, tol=1e-2, interpret=None)


# FP8 caches at real sizes: decode, a mixed batch, a prefill, and head_dim 64 (64-byte FP8 rows).
# The table's configs, and with scores in FP8 (``fp8_scores``, e4m3 only).
GPU_FP8_CASES = {
    "decode-64x4k-e4m3": (GPU_CASES["decode-64x4k"], jnp.float8_e4m3fn, None),
    "mixed-e4m3": (GPU_CASES["mixed"], jnp.float8_e4m3fn, None),
    "prefill-2k-e5m2": (GPU_CASES["prefill-2k"], jnp.float8_e5m2, None),
    "head-dim-64-e4m3": (GPU_CASES["head-dim-64"], jnp.float8_e4m3fn, None),
    "decode-64x4k-e4m3-fp8-scores": (GPU_CASES["decode-64x4k"], jnp.float8_e4m3fn, dict(fp8_scores=True)),
    "mixed-e4m3-fp8-scores": (GPU_CASES["mixed"], jnp.float8_e4m3fn, dict(fp8_scores=True)),
    "head-dim-64-e4m3-fp8-scores": (GPU_CASES["head-dim-64"], jnp.float8_e4m3fn, dict(fp8_scores=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_FP8_CASES))
def test_compiled_kernel_over_fp8_cache_matches_reference(name):
    case, cache_dtype, switches = GPU_FP8_CASES[name]
    _kernel_vs_reference(
        case, seed=7, config=None, tol=1e-2, interpret=None, cache_dtype=cache_dtype, switches=switches
    )


@pytest.mark.gpu
def test_model_logits_through_the_kernel_match_the_reference_path(monkeypatch):
    """A whole bf16 model, two steps (prefills, then a chunk and decodes), kernel path vs reference path."""
    from packed_batch import packed_metadata
    from test_model_parity import jitted_step, pack, random_prompts

    from jaxrunner.envs import ATTENTION_IMPL_ENV_VAR
    from jaxrunner.models import TransformerConfig, init_random_model

    config = TransformerConfig(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2048,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
    )
    model = init_random_model(config, dtype="bfloat16", seed=0)
    prompts = random_prompts(config.vocab_size, [300, 17, 64, 129], seed=2)
    first, second = [200, 17, 64, 129], [100, 0, 1, 1]
    packed = functools.partial(packed_metadata, block_size=16, num_blocks=160, blocks_per_req=32, num_reqs=5)
    md1, pos1 = packed(first, num_tokens=512)
    md2, pos2 = packed([300, 17, 65, 130], second, num_tokens=128)
    shape = (160, 16, config.num_kv_heads, config.head_dim)
    logits = {}
    for impl in ("reference", "mosaic_gpu"):
        monkeypatch.setenv(ATTENTION_IMPL_ENV_VAR, impl)
        step = jitted_step(model)
        caches = [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)) for _ in range(config.num_layers)]
        out1, caches = step(pack([p[:n] for p, n in zip(prompts, first)], 512), jnp.asarray(pos1), caches, md1)
        decode_ids = [prompts[0][200:], [], [7], [9]]
        out2, _ = step(pack(decode_ids, 128), jnp.asarray(pos2), caches, md2)
        logits[impl] = np.concatenate([np.asarray(out1)[: sum(first)], np.asarray(out2)[: sum(second)]])
    ref, got = logits["reference"], logits["mosaic_gpu"]
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2
