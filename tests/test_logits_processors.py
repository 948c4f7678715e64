"""Logits processors and token bitmasks against straightforward NumPy references.

Every batch mixes rows that use the feature with neutral rows, which must come
back bit-identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.sample.bitmask import apply_token_bitmask, num_words, pack_token_ids
from jaxrunner.sample.logits_processors import (
    apply_bad_words,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
)

N, VOCAB = 10, 1000  # 1000 is not a multiple of 32


def _logits(rng: np.random.Generator, n: int = N, vocab: int = VOCAB) -> np.ndarray:
    """Random logits with a few -inf already present."""
    x = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    x[rng.random((n, vocab)) < 0.02] = -np.inf
    return x


def _assert_rows(got, want, neutral: np.ndarray, inputs: np.ndarray) -> None:
    got = np.asarray(got)
    np.testing.assert_array_equal(got, want)
    assert got[neutral].tobytes() == inputs[neutral].tobytes()


def _bit(words: np.ndarray, v: int) -> bool:
    return (int(words[v // 32]) >> (v % 32)) & 1 == 1


def _unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[..., vocab_size] from int32[..., bitmask_words] words."""
    words = np.asarray(words, dtype=np.int32).view(np.uint32)
    bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(bool)


def test_pack_and_unpack_round_trip():
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, VOCAB, 152_064):
        ids = np.unique(rng.integers(0, vocab, rng.integers(1, 50)))
        words = pack_token_ids(ids.tolist(), vocab)
        assert words.dtype == np.int32 and words.shape == (num_words(vocab),)
        assert {v for v in range(vocab) if _bit(words, v)} == set(ids.tolist())
        np.testing.assert_array_equal(np.flatnonzero(_unpack_bitmask(words, vocab)), ids)
    assert pack_token_ids([31], 32)[0] == np.int32(-(1 << 31))  # the sign bit is token 31
    with pytest.raises(ValueError):
        pack_token_ids([VOCAB], VOCAB)


def test_token_bitmask_matches_numpy():
    rng = np.random.default_rng(1)
    logits = _logits(rng)
    words = rng.integers(-(1 << 31), 1 << 31, (N, num_words(VOCAB)), dtype=np.int64).astype(np.int32)
    words[:, -1] |= np.int32(-(1 << 31))  # a bit past V set: ignored
    active = np.arange(N) % 3 != 0
    want = logits.copy()
    for i in np.flatnonzero(active):
        for v in range(VOCAB):
            if not _bit(words[i], v):
                want[i, v] = -np.inf
    got = jax.jit(apply_token_bitmask)(logits, words, active)
    _assert_rows(got, want, ~active, logits)


def test_logit_bias_matches_numpy_and_duplicates_add():
    rng = np.random.default_rng(2)
    logits, k = _logits(rng), 6
    ids = rng.integers(0, VOCAB, (N, k)).astype(np.int32)
    ids[:, -1] = ids[:, 0]  # the same token twice in every row
    ids[rng.random((N, k)) < 0.2] = -1
    ids[::3] = -1  # neutral rows
    values = rng.normal(0, 5, (N, k)).astype(np.float32)
    want = logits.copy()
    for i in range(N):
        for token, value in zip(ids[i], values[i]):
            if token >= 0:
                want[i, token] += value
    got = jax.jit(apply_logit_bias)(logits, ids, values)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)  # duplicate order may differ
    assert np.asarray(got)[::3].tobytes() == logits[::3].tobytes()
    assert np.asarray(got)[0, VOCAB - 1] == logits[0, VOCAB - 1]  # -1 is not token V - 1


def test_min_tokens_masks_stop_ids_of_active_rows():
    rng = np.random.default_rng(3)
    logits = _logits(rng)
    stop = rng.integers(0, VOCAB, (N, 4)).astype(np.int32)
    stop[:, 3] = -1
    active = rng.random(N) < 0.6
    want = logits.copy()
    for i in np.flatnonzero(active):
        want[i, stop[i][stop[i] >= 0]] = -np.inf
    got = jax.jit(apply_min_tokens)(logits, stop, active)
    _assert_rows(got, want, ~active, logits)


def test_penalties_match_numpy():
    rng = np.random.default_rng(4)
    logits = _logits(rng)
    prompt_sets = [np.unique(rng.integers(0, VOCAB, 40)) for _ in range(N)]
    prompt_bitmask = np.stack([pack_token_ids(s.tolist(), VOCAB) for s in prompt_sets])
    counts = np.zeros((N, VOCAB), np.int32)
    for i in range(N):
        np.add.at(counts[i], rng.integers(0, VOCAB, 30), 1)
    repetition = rng.uniform(0.5, 2.0, N).astype(np.float32)
    frequency = rng.uniform(-1, 1, N).astype(np.float32)
    presence = rng.uniform(-1, 1, N).astype(np.float32)
    neutral = np.arange(N) % 3 == 0
    repetition[neutral], frequency[neutral], presence[neutral] = 1.0, 0.0, 0.0
    frequency[1] = presence[1] = 0.0  # repetition only
    repetition[2] = 1.0  # frequency and presence only

    want = logits.copy()
    for i in range(N):
        seen = np.zeros(VOCAB, bool)
        seen[prompt_sets[i]] = True
        seen |= counts[i] > 0
        row = want[i]
        row[seen] = np.where(row[seen] > 0, row[seen] / repetition[i], row[seen] * repetition[i])
        row -= frequency[i] * counts[i].astype(np.float32)
        row -= presence[i] * (counts[i] > 0).astype(np.float32)
    got = jax.jit(apply_penalties)(logits, prompt_bitmask, counts, repetition, frequency, presence)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert np.asarray(got)[neutral].tobytes() == logits[neutral].tobytes()


def _numpy_bad_words(logits, words: list[list[list[int]]], past: list[list[int]]) -> np.ndarray:
    """vLLM's list-based rule: ban word[-1] when word[:-1] ends the past tokens."""
    out = logits.copy()
    for i, row_words in enumerate(words):
        for word in row_words:
            prefix = word[:-1]
            if len(prefix) <= len(past[i]) and (not prefix or past[i][-len(prefix) :] == prefix):
                out[i, word[-1]] = -np.inf
    return out


def test_bad_words_match_numpy():
    rng = np.random.default_rng(5)
    n, vocab, num_words_, length = 40, 50, 4, 4  # small vocab: many coincidences
    logits = _logits(rng, n, vocab)
    past = [rng.integers(0, vocab, rng.integers(0, 7)).tolist() for _ in range(n)]
    words = []
    for i in range(n):
        row = []
        for _ in range(rng.integers(0, num_words_ + 1) if i % 4 else 0):  # every 4th row: none
            m = int(rng.integers(1, length + 1))  # lengths 1 .. L
            tail = past[i][len(past[i]) - (m - 1) :] if 0 < m - 1 <= len(past[i]) else []
            prefix = tail if tail and rng.random() < 0.6 else rng.integers(0, vocab, m - 1).tolist()
            row.append(prefix + [int(rng.integers(0, vocab))])
        words.append(row)
    bad = np.full((n, num_words_, length), -1, np.int32)
    history = np.full((n, length - 1), -1, np.int32)
    for i in range(n):
        for j, word in enumerate(words[i]):
            bad[i, j, length - len(word) :] = word
        tail = past[i][-(length - 1) :]
        history[i, length - 1 - len(tail) :] = tail
    want = _numpy_bad_words(logits, words, past)
    got = jax.jit(apply_bad_words)(logits, bad, history)
    neutral = np.array([not w for w in words])
    _assert_rows(got, want, neutral, logits)
    assert any(len(w) == length and not np.isfinite(want[i, w[-1]]) for i in range(n) for w in words[i])


def test_bad_words_edge_cases():
    logits = np.zeros((3, 8), np.float32)
    bad = np.array(
        [
            [[-1, -1, 5], [-1, -1, -1]],  # length 1: always banned
            [[1, 2, 6], [-1, 2, 7]],  # length L matches, length 2 does not
            [[1, 3, 4], [-1, -1, -1]],  # history shorter than the bad word
        ],
        np.int32,
    )
    history = np.array([[-1, -1], [1, 2], [-1, 3]], np.int32)
    got = np.asarray(apply_bad_words(jnp.asarray(logits), jnp.asarray(bad), jnp.asarray(history)))
    assert np.flatnonzero(np.isinf(got[0])).tolist() == [5]
    assert np.flatnonzero(np.isinf(got[1])).tolist() == [6, 7]
    assert not np.isinf(got[2]).any()


def test_min_p_matches_numpy():
    rng = np.random.default_rng(6)
    logits = _logits(rng)
    min_p = rng.uniform(0, 0.5, N).astype(np.float32)
    min_p[::3] = 0.0
    min_p[1] = 1.0
    logits[1, :4] = logits[1].max()  # min_p 1 keeps exactly the ties at the max
    want = logits.copy()
    for i in np.flatnonzero(min_p > 0):
        threshold = logits[i].max() + np.log(min_p[i])
        want[i, logits[i] < threshold] = -np.inf
    got = jax.jit(apply_min_p)(logits, min_p)
    _assert_rows(got, want, min_p == 0, logits)
    kept = np.flatnonzero(np.isfinite(np.asarray(got)[1])).tolist()
    assert kept == [0, 1, 2, 3, int(np.argmax(logits[1, 4:])) + 4]
