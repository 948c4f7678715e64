"""Sort-free top-k / top-p masking: exact thresholds by a radix search over float bits.

A float32 maps to a uint32 key whose unsigned order is the float order, so
"the k-th largest logit" and "the top-p cut-off logit" are each the largest key
t at which a monotone per-row quantity (the count, or the probability mass, of
keys >= t) still reaches a target. A radix search fixes RADIX_BITS bits of t per
pass over the vocabulary, most significant first, testing all 2**RADIX_BITS - 1
next digits at once. The thresholds found are keys of actual logits, so the
kept set (everything >= the threshold, ties included) is the one the sorted
method keeps.

Cost, counted in reads and writes of an [n, V] array of 4-byte elements: the
keys and row minimum (~3); top-k, 8 passes over the keys, each a single
variadic reduction doing 15 compare-and-counts per element; the softmax
weights and their sum (~5); top-p, 8 passes over keys and weights (16), each
15 compare-and-adds per element; the final select (3). About 35 in all, about
5.5 GB at n = 256, V = 152k (~2 ms at the 2.6 TB/s measured on the H200), with
no sort, cumsum or gather. A batch in which no row uses top-k skips its 8
passes (~27 left), and one in which no row uses top-p skips the top-p part (~14).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

RADIX_BITS = 4


def float_order_key(x: Float[Array, "*shape"]) -> UInt32[Array, "*shape"]:
    """uint32 keys in the order of the float32 values (-0.0 first becomes +0.0, so
    the two zeros tie as they do as floats)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _sums_at_or_above(
    key: UInt32[Array, "num_rows vocab_size"],
    candidates: UInt32[Array, "num_rows num_candidates"],
    weight: Float[Array, "num_rows vocab_size"] | None,
) -> Array:
    """[n, D]: per row and candidate c, the count (``weight`` None) or the weight sum
    of the elements with key >= c. One variadic reduction over V, so a GPU reads
    each element once for all D candidates."""
    hits = [key >= candidates[:, d, None] for d in range(candidates.shape[1])]
    if weight is None:
        terms = tuple(hit.astype(jnp.int32) for hit in hits)
    else:
        terms = tuple(jnp.where(hit, weight, 0.0) for hit in hits)
    zeros = tuple(np.zeros((), term.dtype) for term in terms)
    add = lambda a, b: tuple(x + y for x, y in zip(a, b))
    return jnp.stack(jax.lax.reduce(terms, zeros, add, (1,)), axis=-1)


def _largest_key_reaching(
    key: UInt32[Array, "num_rows vocab_size"],
    target: Array,
    weight: Float[Array, "num_rows vocab_size"] | None = None,
) -> UInt32[Array, " num_rows"]:
    """Per row, the largest t with (sum of ``weight`` over key >= t) >= ``target``.

    ``weight`` None counts elements. Weights must be non-negative, so the sum
    falls as t rises and the digits can be fixed from the top, each one as the
    number of candidate digits whose sum still reaches the target. If even
    t = 0 (every element) falls short, the answer is 0.
    """
    digits = jnp.arange(1, 1 << RADIX_BITS, dtype=jnp.uint32)

    def fix_digit(step: Array, t: UInt32[Array, " num_rows"]) -> UInt32[Array, " num_rows"]:
        shift = (32 - RADIX_BITS * (step + 1)).astype(jnp.uint32)
        above = _sums_at_or_above(key, t[:, None] | (digits << shift), weight)
        return t | (jnp.sum(above >= target[:, None], axis=-1, dtype=jnp.uint32) << shift)

    return jax.lax.fori_loop(0, 32 // RADIX_BITS, fix_digit, jnp.zeros(key.shape[0], jnp.uint32))


def apply_top_k_top_p(
    logits: Float[Array, "num_rows vocab_size"],
    top_k: Int[Array, " num_rows"],
    top_p: Float[Array, " num_rows"],
) -> Float[Array, "num_rows vocab_size"]:
    """Mask (to -inf) float32 logits outside the top-k, then outside the top-p nucleus.

    top_k 0 (or >= V) and top_p >= 1 are off; a row with both off is returned
    untouched. Top-k keeps logits >= the k-th largest (ties kept). The nucleus
    is the smallest set of most likely top-k-kept tokens whose probability,
    renormalised over the top-k-kept tokens, reaches top_p; ties at its
    cut-off are kept and so is the argmax (whatever top_p).
    """
    vocab = logits.shape[-1]
    key = float_order_key(logits)
    uses_k = (top_k > 0) & (top_k < vocab)
    uses_p = top_p < 1.0
    row_min = jnp.min(key, axis=-1)

    def kth_largest(_: None) -> UInt32[Array, " num_rows"]:
        k = jnp.where(uses_k, top_k, vocab)
        return _largest_key_reaching(key, k)

    kth = jax.lax.cond(jnp.any(uses_k), kth_largest, lambda _: row_min, None)

    def nucleus_cutoff(_: None) -> UInt32[Array, " num_rows"]:
        row_max = jnp.max(logits, axis=-1)
        mass = jnp.where(key >= kth[:, None], jnp.exp(logits - row_max[:, None]), 0.0)
        total = jnp.sum(mass, axis=-1)
        # The cut-off is the smallest logit whose strictly-larger mass is < top_p,
        # i.e. the largest t whose mass at or above t still reaches top_p.
        cutoff = _largest_key_reaching(key, top_p * total, mass)
        return jnp.maximum(jnp.minimum(cutoff, float_order_key(row_max)), kth)

    cutoff = jax.lax.cond(jnp.any(uses_p), nucleus_cutoff, lambda _: kth, None)
    cutoff = jnp.where(uses_p, cutoff, kth)
    drop = (uses_k | uses_p)[:, None] & (key < cutoff[:, None])
    return jnp.where(drop, -jnp.inf, logits)
