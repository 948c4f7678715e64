"""NgramProposer: hand-made histories, a brute-force reference, and speed; the device's NgramDrafter against it."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.engine.ngram_proposer import NgramProposer
from jaxrunner.runner.spec_decode.ngram import NO_DRAFT, NgramDrafter


def reference_propose(history: list[int], k: int, lo: int, hi: int, max_model_len: int | None) -> list[int]:
    """Brute force: longest n first, then the leftmost earlier start."""
    length = len(history)
    if max_model_len is not None:
        k = min(k, max_model_len - length)
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        suffix = history[length - n :] if n <= length else None
        for start in range(length - n):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def test_repeated_phrase():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]


def test_longest_ngram_beats_shorter():
    # Suffix [7, 8, 9]: "9" alone matches first at index 1 (-> 5), but the
    # 3-gram [7, 8, 9] matches at index 3 (-> 6) and must win.
    p = NgramProposer(2, 1, 3)
    assert p.propose([0, 9, 5, 7, 8, 9, 6, 1, 7, 8, 9]) == [6, 1]


def test_leftmost_match_among_equal_length():
    p = NgramProposer(2, 2, 2)
    assert p.propose([4, 5, 10, 11, 4, 5, 20, 21, 4, 5]) == [10, 11]


def test_match_near_end_gives_fewer_tokens():
    # The only earlier [3, 3] overlaps the suffix; one token follows it.
    p = NgramProposer(5, 2, 2)
    assert p.propose([1, 2, 3, 3, 3]) == [3]
    assert NgramProposer(4, 2, 2).propose([1, 2, 5, 6, 1, 2]) == [5, 6, 1, 2]


def test_no_match():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([]) == []
    assert p.propose([7]) == []


def test_ngram_longer_than_history():
    assert NgramProposer(3, 3, 5).propose([1, 1]) == []
    # prompt_lookup_max far above the history still finds shorter n-grams.
    assert NgramProposer(3, 1, 50).propose([2, 3, 2]) == [3, 2]


def test_below_min_ngram_is_no_match():
    # Only a 1-gram recurs; min of 2 rejects it.
    assert NgramProposer(3, 2, 3).propose([5, 1, 2, 6, 2]) == []


def test_max_model_len_cap():
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer(4, 1, 3, max_model_len=100).propose(history) == [3, 4, 5, 6]
    assert NgramProposer(4, 1, 3, max_model_len=10).propose(history) == [3, 4]
    assert NgramProposer(4, 1, 3, max_model_len=8).propose(history) == []


def test_accepts_numpy_and_batches():
    p = NgramProposer(2, 1, 2)
    histories = [np.array([1, 2, 1], dtype=np.int32), [3, 4], [5, 6, 5, 6]]
    assert [p.propose(h) for h in histories] == [[2, 1], [], [5, 6]]
    assert all(type(t) is int for t in p.propose(histories[0]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_speculative_tokens=0),
        dict(num_speculative_tokens=2, prompt_lookup_min=0),
        dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
        dict(num_speculative_tokens=2, max_model_len=0),
    ],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        NgramProposer(**kwargs)


def test_rejects_2d_history():
    with pytest.raises(ValueError):
        NgramProposer(2).propose(np.zeros((2, 3), dtype=np.int64))


def test_random_histories_match_reference():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        length = int(rng.integers(0, 40))
        vocab = int(rng.integers(1, 6))
        history = rng.integers(0, vocab, size=length).tolist()
        k = int(rng.integers(1, 6))
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        max_len = None if rng.random() < 0.5 else int(rng.integers(1, 50))
        got = NgramProposer(k, lo, hi, max_len).propose(np.array(history, dtype=np.int64))
        assert got == reference_propose(history, k, lo, hi, max_len), (
            history,
            k,
            lo,
            hi,
            max_len,
        )


def test_4k_history_is_fast():
    rng = np.random.default_rng(1)
    history = rng.integers(0, 32000, size=4096).astype(np.int32)
    history[-3:] = history[1000:1003]
    p = NgramProposer(5, 1, 3)
    assert p.propose(history) == history[1003:1008].tolist()
    no_match = np.arange(4096, dtype=np.int32)
    reps = 200
    start = time.perf_counter()
    for _ in range(reps):
        p.propose(history)
        p.propose(no_match)
    per_call = (time.perf_counter() - start) / (2 * reps)
    assert per_call < 5e-3, f"{per_call * 1e3:.3f} ms per propose"


@pytest.mark.parametrize("seed", range(4))
def test_device_proposer_drafts_what_the_host_proposes(seed):
    """NgramDrafter ("ngram_gpu") over a batch of slots of a token table: per row, the host
    proposer's drafts over the same history (within max_model_len, the table's width),
    then -1 for the drafts it lacks."""
    rng = np.random.default_rng(seed)
    max_model_len, num_slots, k = 48, 64, int(rng.integers(1, 6))
    lo = int(rng.integers(1, 4))
    hi = lo + int(rng.integers(0, 4))
    table = rng.integers(0, int(rng.integers(2, 6)), size=(num_slots, max_model_len)).astype(np.int32)
    slots = rng.permutation(num_slots)[:40].astype(np.int32)
    lengths = rng.integers(1, max_model_len + 1, size=40).astype(np.int32)
    drafts = np.asarray(NgramDrafter(k, lo, hi).propose(jnp.asarray(table), jnp.asarray(slots), jnp.asarray(lengths)))
    host = NgramProposer(k, lo, hi, max_model_len)
    for row, (slot, length) in enumerate(zip(slots, lengths)):
        want = host.propose(table[slot, :length])
        assert drafts[row].tolist() == want + [NO_DRAFT] * (k - len(want)), (slot, length)
