"""Seeded Gumbel noise from a murmur3 hash of (seed, position, token id).

The noise for a token is a pure function of the request's seed, the token's
position and its id, so a seeded request samples the same tokens alone or in
any batch, at any bucket, on any device (vLLM's scheme; tests/test_sampler.py checks
known-answer vectors).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, UInt32

_C1 = 0xCC9E2D51
_C2 = 0x1B873593


def _rotl(x: Array, r: int) -> Array:
    return (x << r) | (x >> (32 - r))


def _mix(h: Array, k: Array) -> Array:
    k = k * jnp.uint32(_C1)
    k = _rotl(k, 15)
    k = k * jnp.uint32(_C2)
    h = h ^ k
    h = _rotl(h, 13)
    return h * jnp.uint32(5) + jnp.uint32(0xE6546B64)


def _fmix32(h: Array) -> Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(
    seed_lo: UInt32[Array, "..."],
    seed_hi: UInt32[Array, "..."],
    pos: UInt32[Array, "..."],
    token: UInt32[Array, "..."],
    domain: int = 0,
) -> UInt32[Array, "..."]:
    """murmur3 over four 32-bit words: seed low, seed high, position low, token id."""
    h = jnp.full(jnp.broadcast_shapes(seed_lo.shape, pos.shape, token.shape), domain, jnp.uint32)
    for word in (seed_lo, seed_hi, pos, token):
        h = _mix(h, word.astype(jnp.uint32))
    return _fmix32(h ^ jnp.uint32(16))


def gumbel_from_hash(h: UInt32[Array, "..."]) -> Float[Array, "..."]:
    """Gumbel noise ``-log(-log(u))`` with ``u = (h + 0.5) / 2**32``, in float32.

    ``-log(u)`` is taken from whichever of ``u`` and ``1 - u`` is the smaller,
    both exact from the integer hash, so no hash maps to an infinite value.
    """
    scale = jnp.float32(2.0**-32)
    u = (h.astype(jnp.float32) + 0.5) * scale
    one_minus_u = ((~h).astype(jnp.float32) + 0.5) * scale
    neg_log_u = jnp.where(u < 0.5, -jnp.log(u), -jnp.log1p(-one_minus_u))
    return -jnp.log(neg_log_u)


def split_seed(seed: int) -> tuple[int, int]:
    """A signed or unsigned 64-bit seed as its (low, high) 32-bit words."""
    value = seed & 0xFFFFFFFFFFFFFFFF
    return value & 0xFFFFFFFF, value >> 32
