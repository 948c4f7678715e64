"""The ragged paged attention reference against dense float64 attention per request.

Every case is a random mixed batch (decodes, chunked prefills, full prefills) over
a paged cache with shuffled block tables, with padded tokens and padded requests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.ops import AttentionMetadata, ragged_paged_attention
from jaxrunner.ops.attention_reference import (
    MAX_CHUNK_ELEMENTS,
    chunk_plan,
    ragged_paged_attention_reference,
)

# (num_computed_tokens, query_len) per request.
MIXED = ((40, 1), (15, 1), (0, 17), (33, 15), (0, 1), (16, 16), (7, 9), (0, 40))
ODD = ((0, 1), (14, 1), (0, 15), (0, 17), (1, 7), (16, 1), (8, 8), (2, 15))
LONG = ((100, 20), (90, 1), (0, 60), (121, 1))
TINY_BUDGET = 1  # one block per chunk: many loop iterations


@dataclasses.dataclass(frozen=True)
class Case:
    reqs: tuple[tuple[int, int], ...] = MIXED
    block_size: int = 16
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    sliding_window: int | None = None
    soft_cap: float | None = None
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS
    pad_tokens: int = 5
    pad_reqs: int = 2
    dtype: jnp.dtype = jnp.float32


def _make_inputs(case: Case, seed: int):
    """Random q and caches, and metadata over a shuffled (non-contiguous) block pool."""
    rng = np.random.default_rng(seed)
    bs = case.block_size
    seq_lens = [computed + query for computed, query in case.reqs]
    query_lens = [query for _, query in case.reqs]
    blocks_per_req = [-(-s // bs) for s in seq_lens]
    num_reqs = len(case.reqs) + case.pad_reqs
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 7
    pool = rng.permutation(num_blocks)
    # Unused entries (and padded requests) point at random blocks: masking must ignore them.
    block_tables = rng.integers(0, num_blocks, (num_reqs, max_blocks))
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = pool[sum(blocks_per_req[:r]) : sum(blocks_per_req[: r + 1])]

    num_real = sum(query_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens), np.full(case.pad_reqs, num_real)])
    slot_mapping = np.full(num_real + case.pad_tokens, -1)
    for r, (computed, query) in enumerate(case.reqs):
        pos = computed + np.arange(query)
        slot_mapping[query_start_loc[r] : query_start_loc[r + 1]] = block_tables[r, pos // bs] * bs + pos % bs
    metadata = AttentionMetadata(
        query_start_loc=jnp.asarray(query_start_loc, jnp.int32),
        seq_lens=jnp.asarray(seq_lens + [0] * case.pad_reqs, jnp.int32),
        block_tables=jnp.asarray(block_tables, jnp.int32),
        slot_mapping=jnp.asarray(slot_mapping, jnp.int32),
    )
    cache_shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(cache_shape), case.dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((len(slot_mapping), case.num_q_heads, case.head_dim)), case.dtype)
    return q, k_cache, v_cache, metadata


def _dense_oracle(case: Case, q, k_cache, v_cache, metadata, sm_scale) -> np.ndarray:
    """Float64 dense causal attention per request over its K/V gathered by block table."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    qsl, seq_lens, tables = (
        np.asarray(x) for x in (metadata.query_start_loc, metadata.seq_lens, metadata.block_tables)
    )
    group = case.num_q_heads // case.num_kv_heads
    out = np.zeros_like(q)
    for r in range(len(case.reqs)):
        seq_len, rows = seq_lens[r], slice(qsl[r], qsl[r + 1])
        pos = np.arange(seq_len)
        slots = tables[r, pos // case.block_size], pos % case.block_size
        k = np.repeat(k_cache[slots], group, axis=1)  # [seq, H, D]
        v = np.repeat(v_cache[slots], group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[rows], k) * sm_scale
        if case.soft_cap:
            scores = case.soft_cap * np.tanh(scores / case.soft_cap)
        q_pos = seq_len - (qsl[r + 1] - np.arange(qsl[r], qsl[r + 1]))
        visible = pos[None, :] <= q_pos[:, None]
        if case.sliding_window:
            visible &= pos[None, :] > q_pos[:, None] - case.sliding_window
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[rows] = np.einsum("hqk,khd->qhd", weights, v)
    return out


_jitted_reference = jax.jit(
    ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "soft_cap", "max_chunk_elements")
)


def _run(case: Case, seed: int, jit: bool = True):
    """Reference output (as float64) and the oracle, for the inputs of ``seed``."""
    q, k_cache, v_cache, metadata = _make_inputs(case, seed)
    sm_scale = case.head_dim**-0.5
    attend = _jitted_reference if jit else ragged_paged_attention_reference
    out = attend(
        q,
        k_cache,
        v_cache,
        metadata,
        sm_scale=sm_scale,
        sliding_window=case.sliding_window,
        soft_cap=case.soft_cap,
        max_chunk_elements=case.max_chunk_elements,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    return np.asarray(out, np.float64), _dense_oracle(case, q, k_cache, v_cache, metadata, sm_scale)


def _check(case: Case, out: np.ndarray, ref: np.ndarray, tol: float) -> None:
    """Relative error over real tokens below ``tol``; padded tokens exactly zero; no NaN."""
    assert np.isfinite(out).all()
    num_real = sum(query for _, query in case.reqs)
    real, want = out[:num_real], ref[:num_real]
    assert np.linalg.norm(real - want) / np.linalg.norm(want) < tol
    np.testing.assert_array_equal(out[num_real:], 0.0)


CASES = {
    "mixed": Case(),
    "window": Case(sliding_window=7),
    "soft_cap": Case(soft_cap=1.5),
    "odd_bs8_d128_mha": Case(reqs=ODD, block_size=8, num_q_heads=4, num_kv_heads=4, head_dim=128),
    "odd_bs8_window_cap": Case(reqs=ODD, block_size=8, sliding_window=17, soft_cap=3.0),
    "many_chunks": Case(max_chunk_elements=TINY_BUDGET),
    "long_window_many_chunks": Case(reqs=LONG, block_size=8, sliding_window=9, max_chunk_elements=TINY_BUDGET),
    "mqa_d32_many_chunks": Case(reqs=LONG, num_q_heads=8, num_kv_heads=1, head_dim=32, max_chunk_elements=1 << 14),
    "decode_only": Case(reqs=((37, 1), (1, 1), (16, 1), (70, 1)), pad_tokens=0),
    "single_prefill": Case(reqs=((0, 33),), pad_reqs=0, pad_tokens=0),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_dense_oracle_float32(name):
    case = CASES[name]
    for seed in range(2):
        _check(case, *_run(case, seed), tol=1e-5)


def test_matches_dense_oracle_bfloat16():
    case = Case(sliding_window=21, soft_cap=4.0, dtype=jnp.bfloat16)
    _check(case, *_run(case, seed=7), tol=1e-2)


def test_eager_matches_jit_and_oracle():
    case = Case(sliding_window=11, max_chunk_elements=1 << 15)
    eager, ref = _run(case, seed=3, jit=False)
    jitted, _ = _run(case, seed=3)
    _check(case, jitted, ref, tol=1e-5)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)


def test_all_padding_gives_zeros():
    case = Case(reqs=((0, 1),))
    q, k_cache, v_cache, metadata = _make_inputs(case, seed=5)
    empty = dataclasses.replace(
        metadata,
        query_start_loc=jnp.zeros_like(metadata.query_start_loc),
        seq_lens=jnp.zeros_like(metadata.seq_lens),
    )
    out = ragged_paged_attention_reference(q, k_cache, v_cache, empty, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_public_entry_dispatch():
    case = Case()
    q, k_cache, v_cache, metadata = _make_inputs(case, seed=9)
    want = ragged_paged_attention_reference(q, k_cache, v_cache, metadata, sm_scale=0.125, soft_cap=2.0)
    for impl in (None, "reference"):
        got = ragged_paged_attention(q, k_cache, v_cache, metadata, sm_scale=0.125, soft_cap=2.0, impl=impl)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="reference"):
        ragged_paged_attention(q, k_cache, v_cache, metadata, sm_scale=0.125, impl="pallas")


# Real sizes: Llama-3-8B attention (32 q / 8 kv heads, head_dim 128), block 16.
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.mark.parametrize(
    "num_tokens, num_reqs, context",
    [(64, 64, 4096), (1024, 1024, 4096), (8192, 1, 8192), (8192, 256, 8192), (512, 8, 32768)],
)
def test_chunk_plan_stays_within_budget(num_tokens, num_reqs, context):
    plan = chunk_plan(num_tokens, num_reqs, max_blocks_per_req=context // 16, **LLAMA)
    assert plan.chunk_elements(**LLAMA) <= MAX_CHUNK_ELEMENTS
    assert plan.num_tiles * plan.query_tile >= num_tokens


def test_decode_batch_is_a_handful_of_iterations():
    plan = chunk_plan(64, 64, max_blocks_per_req=256, **LLAMA)
    assert plan.query_tile == 1
    assert -(-4096 // (plan.chunk_blocks * 16)) <= 8


def test_prefill_8k_compiles_to_bounded_memory():
    """The compiled 8k-token prefill needs far less than the 8 GiB of dense fp32 scores."""
    num_tokens, context = 8192, 8192
    heads, kv_heads, dim, bs = (LLAMA[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"))
    q = jax.ShapeDtypeStruct((num_tokens, heads, dim), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((context // bs + 8, bs, kv_heads, dim), jnp.bfloat16)
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)  # small: lowering reads only their shapes
    metadata = AttentionMetadata(i32((2,)), i32((1,)), i32((1, context // bs)), i32((num_tokens,)))
    attend = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=dim**-0.5))
    stats = attend.lower(q, cache, cache, metadata).compile().memory_analysis()
    assert stats is not None and stats.temp_size_in_bytes < 2 << 30
