"""Seeded noise: murmur3 known answers and the Gumbel distribution."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrunner.sample.gumbel import gumbel_from_hash, murmur3_hash32, split_seed

# (seed, pos, token) -> (hash with domain 0, hash with domain 0x9E3779B9): vLLM's murmur3 scheme's values.
KNOWN_ANSWERS = [
    ((0, 0, 0), (0x8134CDF8, 0xD28AD962)),
    ((1, 2, 3), (0x23B53F91, 0xE3AAF818)),
    ((-1, 17, 1023), (0xC8C13C14, 0xD223C51C)),
    ((0x123456789ABCDEF, 123456789, 199999), (0x5DDE974F, 0x0547D2FE)),
    ((-(1 << 63), 1 << 30, 4096), (0xF1A9355B, 0x3AED160F)),
    (((1 << 63) - 1, (1 << 30) + 7, 0xFFFFFFFF), (0xD952F9AA, 0x49E8EA7F)),
]


@pytest.mark.parametrize("inputs, expected", KNOWN_ANSWERS)
def test_murmur3_known_answers(inputs, expected):
    seed, pos, token = inputs
    lo, hi = split_seed(seed)
    args = [jnp.uint32(v) for v in (lo, hi, pos & 0xFFFFFFFF, token)]
    for domain, want in zip((0, 0x9E3779B9), expected):
        assert int(murmur3_hash32(*args, domain=domain)) == want


def test_gumbel_noise_is_finite_at_the_extremes_and_gumbel_distributed():
    extremes = jnp.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF], jnp.uint32)
    assert np.all(np.isfinite(np.asarray(gumbel_from_hash(extremes))))
    tokens = jnp.arange(200_000, dtype=jnp.uint32)
    g = np.asarray(gumbel_from_hash(murmur3_hash32(jnp.uint32(9), jnp.uint32(0), jnp.uint32(5), tokens)))
    # Kolmogorov-Smirnov against the standard Gumbel distribution.
    assert stats.kstest(g, "gumbel_r").pvalue > 1e-3
    assert stats.kstest(g + 0.05, "gumbel_r").pvalue < 1e-3  # the test can tell a shift
