"""Rejection sampling for speculative decoding: greedy rule, exact distribution, batching."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrunner.config import SamplerConfig
from jaxrunner.sample import rejection_sampler
from jaxrunner.sample.gumbel import gumbel_from_hash, murmur3_hash32
from jaxrunner.sample.rejection_sampler import rejection_sample
from jaxrunner.sample.sampler import sample
from jaxrunner.sample.sampling_state import SamplingArrays

K, V = 3, 10
MASKED = 7  # a token the target forbids at every row


def _seeds(n: int, offset: int = 0):
    lo = np.arange(n, dtype=np.uint32) + np.uint32(offset)
    return jnp.asarray(lo), jnp.asarray(lo * np.uint32(2654435761) + np.uint32(12345))


def _positions(n: int, start: int = 100):
    return jnp.broadcast_to(jnp.arange(start, start + K + 1, dtype=jnp.int32), (n, K + 1))


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def test_greedy_accepts_the_matching_prefix_then_emits_the_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, K + 1, V)).astype(np.float32)
    best = logits.argmax(-1)
    wrong = (best + 1) % V
    drafts = np.stack(
        [
            [best[0, 0], best[0, 1], wrong[0, 2]],  # mismatch at draft 2
            best[1, :K],  # all accepted: bonus from row 3
            wrong[2, :K],  # no drafts at all
            [best[3, 0], best[3, 1], -1],  # two real drafts, both accepted
        ]
    ).astype(np.int32)
    num_drafts = jnp.array([3, 3, 0, 2])
    expected_out = np.array(
        [
            [best[0, 0], best[0, 1], best[0, 2], -1],
            [*best[1, :K], best[1, K]],
            [best[2, 0], -1, -1, -1],
            [best[3, 0], best[3, 1], best[3, 2], -1],
        ]
    )
    dense_q = jnp.asarray(_softmax(rng.normal(size=(4, K, V))), jnp.float32)
    for q in (None, dense_q):  # greedy rows ignore q
        out, n = rejection_sample(
            jnp.asarray(logits), jnp.asarray(drafts), num_drafts, q, jnp.ones(4, bool), *_seeds(4), _positions(4)
        )
        np.testing.assert_array_equal(out, expected_out)
        np.testing.assert_array_equal(n, [3, 4, 1, 3])


@functools.lru_cache
def _target_and_drafts(q_kind: str, num_requests: int = 40_000):
    """Shared p_j (one token masked), and per request drafts drawn from q_j or fixed."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.5, size=(K + 1, V)).astype(np.float32)
    logits[:, MASKED] = -np.inf
    fixed = logits[:K].argmax(-1)
    if q_kind == "onehot":
        logits[np.arange(K), fixed] += 1.5  # p(draft) ~ 0.6, so a good share of rows get to the bonus
    p = _softmax(logits)
    if q_kind == "dense":
        # q proposes the masked token and never proposes token 0, which p allows.
        q = rng.dirichlet(np.ones(V), size=K)
        q[:, 0] = 0.0
        q /= q.sum(-1, keepdims=True)
        drafts = np.stack([rng.choice(V, size=num_requests, p=q[j]) for j in range(K)], axis=1)
        q_arg = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (num_requests, K, V))
    else:
        drafts = np.broadcast_to(fixed, (num_requests, K))
        q_arg = None
    target = jnp.broadcast_to(jnp.asarray(logits), (num_requests, K + 1, V))
    return p, target, jnp.asarray(drafts, jnp.int32), q_arg


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    return stats.chisquare(counts[support], probs[support] / probs[support].sum() * counts.sum()).pvalue


def _position_pvalues(q_kind: str) -> list[float]:
    """Per output position j, the p-value of its tokens (rows that got that far) against p_j."""
    p, target, drafts, q = _target_and_drafts(q_kind)
    n = target.shape[0]
    out, num_sampled = rejection_sample(
        target, drafts, jnp.full(n, K), q, jnp.zeros(n, bool), *_seeds(n, 7), _positions(n)
    )
    out, num_sampled = np.asarray(out), np.asarray(num_sampled)
    pvalues = []
    for j in range(K + 1):
        reached = num_sampled > j
        assert reached.sum() > 3000  # enough rows for the test to have power
        pvalues.append(_chi_square_pvalue(np.bincount(out[reached, j], minlength=V), p[j]))
    return pvalues


@pytest.mark.parametrize("q_kind", ["dense", "onehot"])
def test_each_output_position_is_distributed_as_the_target(q_kind):
    assert min(_position_pvalues(q_kind)) > 1e-3


BROKEN = {
    "accept_always": ("_accepted", lambda logits, drafts, *_: jnp.ones(drafts.shape, bool)),
    "resample_from_p": ("_residual_scores", lambda logits, draft, q: logits),
}


@pytest.mark.parametrize("q_kind", ["dense", "onehot"])
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_the_distribution_test_fails_a_broken_sampler(q_kind, broken, monkeypatch):
    monkeypatch.setattr(rejection_sampler, *BROKEN[broken])
    assert min(_position_pvalues(q_kind)) < 1e-6


@pytest.mark.parametrize("dense_q", [False, True])
def test_rows_with_fewer_drafts_pad_with_minus_one_and_jit_agrees(dense_q):
    n = 64
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.0, size=(n, K + 1, V)).astype(np.float32)
    peak = rng.integers(0, V, size=(n, K + 1))
    np.put_along_axis(logits, peak[..., None], 30.0, axis=-1)  # p(peak) ~ 1: every real draft passes
    num_drafts = np.arange(n) % (K + 1)
    drafts = np.where(np.arange(K) < num_drafts[:, None], peak[:, :K], rng.integers(-5, V + 5, size=(n, K)))
    is_greedy = np.arange(n) % 3 == 0
    q = jnp.asarray(_softmax(rng.normal(size=(n, K, V))), jnp.float32) if dense_q else None
    args = (
        jnp.asarray(logits),
        jnp.asarray(drafts, jnp.int32),
        jnp.asarray(num_drafts, jnp.int32),
        q,
        jnp.asarray(is_greedy),
        *_seeds(n),
        _positions(n),
    )
    out, num_sampled = rejection_sample(*args)
    jit_out, jit_num = jax.jit(rejection_sample)(*args)
    np.testing.assert_array_equal(jit_out, out)
    np.testing.assert_array_equal(jit_num, num_sampled)
    np.testing.assert_array_equal(num_sampled, num_drafts + 1)
    column = np.arange(K + 1)
    expected = np.where(column <= num_drafts[:, None], peak, -1)  # drafts, then the bonus from row num_drafts
    np.testing.assert_array_equal(out, expected)


def test_random_row_without_drafts_samples_what_the_ordinary_sampler_samples():
    n, temperature = 256, 0.8
    rng = np.random.default_rng(4)
    raw = rng.normal(0, 2.0, size=(n, V)).astype(np.float32)
    seed_lo, seed_hi = _seeds(n, 99)
    positions = jnp.asarray(rng.integers(0, 1 << 20, size=(n, K + 1)), jnp.int32)
    target = jnp.zeros((n, K + 1, V), jnp.float32).at[:, 0].set(jnp.asarray(raw) / temperature)
    out, num_sampled = rejection_sample(
        target,
        jnp.zeros((n, K), jnp.int32),
        jnp.zeros(n, jnp.int32),
        None,
        jnp.zeros(n, bool),
        seed_lo,
        seed_hi,
        positions,
    )
    np.testing.assert_array_equal(num_sampled, 1)
    noise = gumbel_from_hash(
        murmur3_hash32(
            seed_lo[:, None], seed_hi[:, None], positions[:, :1].astype(jnp.uint32), jnp.arange(V, dtype=jnp.uint32)
        )
    )
    np.testing.assert_array_equal(out[:, 0], jnp.argmax(target[:, 0] + noise, axis=-1))

    state = SamplingArrays.zeros(n, SamplerConfig(), V)
    state = SamplingArrays(
        **{**state.__dict__, "temperature": jnp.full(n, temperature), "seed_lo": seed_lo, "seed_hi": seed_hi}
    )
    ordinary = sample(
        jnp.asarray(raw),
        state,
        jnp.zeros((n, 4), jnp.int32),
        jnp.arange(n),
        positions[:, 0],
        jnp.zeros((n, -(-V // 32)), jnp.int32),
        jnp.zeros(n, bool),
        max_logprobs=1,
        logprobs_mode="raw_logprobs",
    )
    np.testing.assert_array_equal(out[:, 0], ordinary.sampled_token_ids)
    assert len(np.unique(out[:, 0])) > V // 2


def test_a_rejection_with_no_residual_mass_samples_from_the_target():
    # q >= p everywhere (what rounding can do when q ~ p): every draft can be
    # rejected, max(p - q, 0) is all zero, and token 0, which p forbids, must not come out.
    n = 512
    logits = np.random.default_rng(5).normal(size=(K + 1, V)).astype(np.float32)
    logits[:, 0] = -np.inf
    q = jnp.broadcast_to(jnp.asarray(_softmax(logits[:K]) * 1.5, jnp.float32), (n, K, V))
    drafts = jnp.full((n, K), 1, jnp.int32)
    target = jnp.broadcast_to(jnp.asarray(logits), (n, K + 1, V))
    out, num_sampled = rejection_sample(
        target, drafts, jnp.full(n, K), q, jnp.zeros(n, bool), *_seeds(n), _positions(n)
    )
    last = np.asarray(out)[np.arange(n), np.asarray(num_sampled) - 1]
    assert np.any(np.asarray(num_sampled) <= K)
    assert np.all(last != 0)
