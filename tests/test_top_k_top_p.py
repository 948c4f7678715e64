"""Sort-free top-k / top-p: the exact kept set of a NumPy sort-based reference."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.sample.top_k_top_p import apply_top_k_top_p, float_order_key


def _top_k_keep(row: np.ndarray, top_k: int) -> np.ndarray:
    if 0 < top_k < row.size:
        return row >= np.sort(row)[::-1][top_k - 1]
    return np.ones(row.shape, bool)


def _sorted_mass_before(row: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept logits sorted descending and the float64 probability mass before each."""
    kept = np.sort(row[keep].astype(np.float64))[::-1]
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    return kept, np.cumsum(probs) - probs


def _numpy_keep(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Sort-based reference: top-k by value (ties kept), then the nucleus of the
    top-k-kept tokens, ties at its cut-off kept."""
    keep = _top_k_keep(row, top_k)
    if top_p < 1.0 and np.isfinite(row[keep]).any():
        kept, before = _sorted_mass_before(row, keep)
        num = max(int(np.sum(before < top_p)), 1)
        keep &= row >= kept[num - 1]
    return keep


def _clear_top_p(rng: np.random.Generator, row: np.ndarray, top_k: int, high: float = 1.0) -> float:
    """A random top_p at least 1e-5 away from every mass level where the kept set
    changes, so float32 rounding of the sums cannot decide the answer."""
    kept, before = _sorted_mass_before(row, _top_k_keep(row, top_k))
    levels = before[np.r_[True, kept[1:] != kept[:-1]]]
    for _ in range(1000):
        top_p = np.float32(rng.uniform(0.0, high))
        if np.min(np.abs(levels - top_p)) > 1e-5:
            return float(top_p)
    raise AssertionError("no top_p clear of the mass levels")


def _check(logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, fn=apply_top_k_top_p) -> None:
    """Kept logits bit-identical, the rest -inf; rows with both off untouched."""
    got = np.asarray(fn(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for i, row in enumerate(logits):
        want = np.where(_numpy_keep(row, int(top_k[i]), float(top_p[i])), row, -np.inf)
        assert got[i].tobytes() == want.tobytes(), f"row {i}: top_k {top_k[i]}, top_p {top_p[i]}"


def test_float_order_key_is_monotone_and_zeros_tie():
    values = np.array(
        [-np.inf, -3e38, -1.0, -2e-38, -0.0, 0.0, 2e-38, 1.0, 3e38, np.inf], np.float32
    )  # no subnormals: XLA on CPU flushes them to zero
    keys = np.asarray(float_order_key(jnp.asarray(values))).astype(np.int64)
    assert np.all(np.diff(keys) >= 0)
    assert np.count_nonzero(np.diff(keys) == 0) == 1 and keys[4] == keys[5]


def test_large_vocab_exact_kept_set():
    rng = np.random.default_rng(0)
    vocab = 152_064
    logits = rng.normal(0, 4, (6, vocab)).astype(np.float32)
    logits[5, ::7] = -np.inf
    top_k = np.array([0, 50, 0, 2000, 0, 100_000], np.int32)
    top_p = np.array([1.0, 1.0, 0.0, 0.0, 1e-9, 0.0], np.float32)
    for i in (2, 3, 5):
        top_p[i] = _clear_top_p(rng, logits[i], int(top_k[i]), high=0.9)
    _check(logits, top_k, top_p, jax.jit(apply_top_k_top_p))


def test_many_random_small_rows_with_ties_and_neutral_rows():
    rng = np.random.default_rng(1)
    n, vocab = 400, 97
    continuous = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    tied = (rng.integers(-6, 6, (n, vocab)) / 2).astype(np.float32)  # heavy ties everywhere
    logits = np.where((np.arange(n) % 2 == 0)[:, None], continuous, tied)
    logits[rng.random((n, vocab)) < 0.05] = -np.inf
    top_k = np.where(rng.random(n) < 0.5, 0, rng.integers(1, vocab + 20, n)).astype(np.int32)
    top_p = np.array(
        [_clear_top_p(rng, logits[i], int(top_k[i])) if rng.random() < 0.5 else 1.0 for i in range(n)],
        np.float32,
    )
    _check(logits, top_k, top_p, jax.jit(apply_top_k_top_p))


def test_edge_cases():
    vocab = 40
    base = np.linspace(-2, 2, vocab, dtype=np.float32)
    ties = base.copy()
    ties[[3, 7, 11]] = ties.max()  # three ties at the max
    ties[[20, 21]] = ties[33]  # ties with the 10th largest
    partly_inf = np.full(vocab, -np.inf, np.float32)
    partly_inf[:5] = base[:5]
    rows = [
        (base, vocab + 5, 1.0),  # top_k > V: off
        (base, vocab, 0.5),  # top_k == V: top-p only
        (ties, 0, 1e-9),  # tiny top_p: the argmax and its ties
        (ties, 0, 0.0),  # top_p 0 still keeps the argmax
        (ties, 1, 1.0),  # top_k 1 keeps every tie at the max
        (ties, 10, 1.0),  # ties at the k-th value kept
        (partly_inf, 20, 1.0),  # k-th largest is -inf: nothing finite dropped
        (partly_inf, 3, 0.99),
        (np.full(vocab, -np.inf, np.float32), 5, 0.5),  # nothing finite at all
        (base, 0, 1.0),  # neutral
    ]
    logits = np.stack([r[0] for r in rows])
    top_k = np.array([r[1] for r in rows], np.int32)
    top_p = np.array([r[2] for r in rows], np.float32)
    _check(logits, top_k, top_p)
    got = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    assert np.flatnonzero(np.isfinite(got[2])).tolist() == [3, 7, 11, vocab - 1]
    assert np.isfinite(got[5]).sum() == 12
    assert not np.isnan(got).any()


def test_batches_that_skip_a_search():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (8, 500)).astype(np.float32)
    neutral_k, neutral_p = np.zeros(8, np.int32), np.ones(8, np.float32)
    some_k = np.array([0, 3, 0, 100, 0, 0, 499, 0], np.int32)
    some_p = np.array([1.0, 0.3, 1.0, 0.9, 1.0, 0.6, 1.0, 1.0], np.float32)
    fn = jax.jit(apply_top_k_top_p)
    for top_k, top_p in [(neutral_k, neutral_p), (some_k, neutral_p), (neutral_k, some_p)]:
        _check(logits, top_k, top_p, fn)
