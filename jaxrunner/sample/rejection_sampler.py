"""Rejection sampling for speculative decoding, vLLM's rule, jittable at static shapes.

A request proposes up to K draft tokens and the target model scores K + 1
rows, row j giving p_j over the token after draft j - 1. Drafts pass left to
right while the target agrees with them; the first rejected row emits a token
from the residual max(p_j - q_j, 0), and a request whose drafts all pass emits
a bonus token from the next row. Each emitted token is then distributed
exactly as p (the speculative sampling theorem).

The randomness is a pure function of (seed, position), as in the ordinary
sampler: the acceptance uniform of row j hashes row j's position under
UNIFORM_DOMAIN, and emitted tokens take the sampler's own domain-0 Gumbel noise
at that position, so a request without drafts samples the very token the
ordinary sampler would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32

from jaxrunner.sample.gumbel import gumbel_from_hash, murmur3_hash32

UNIFORM_DOMAIN = 0x9E3779B9


def uniform_from_hash(h: UInt32[Array, "..."]) -> Float[Array, "..."]:
    """``u = (h + 0.5) / 2**32`` in float32: in (0, 1], 1 only where float32 rounds it up."""
    return (h.astype(jnp.float32) + 0.5) * jnp.float32(2.0**-32)


def _at(x: Array, index: Int[Array, "*batch"]) -> Array:
    """``x[..., index]`` elementwise over the leading axes."""
    return jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]


def _accepted(
    logits: Float[Array, "num_rows num_spec vocab_size"],
    drafts: Int[Array, "num_rows num_spec"],
    draft_probs: Float[Array, "num_rows num_spec vocab_size"] | None,
    is_greedy: Bool[Array, " num_rows"],
    seed_lo: UInt32[Array, " num_rows"],
    seed_hi: UInt32[Array, " num_rows"],
    positions: UInt32[Array, "num_rows num_spec"],
) -> Bool[Array, "num_rows num_spec"]:
    """Whether each draft passes its own row's test, regardless of the drafts before it.

    Greedy rows: the draft is the argmax. Random rows: ``p(x) / q(x) >= u``,
    with q one-hot at the draft (q(x) = 1) when ``draft_probs`` is None.
    """
    p = jnp.exp(_at(logits, drafts) - jax.nn.logsumexp(logits, axis=-1))
    q = 1.0 if draft_probs is None else _at(draft_probs, drafts)
    hashes = murmur3_hash32(
        seed_lo[:, None], seed_hi[:, None], positions, jnp.zeros_like(positions), domain=UNIFORM_DOMAIN
    )
    passes = p / q >= uniform_from_hash(hashes)
    return jnp.where(is_greedy[:, None], drafts == jnp.argmax(logits, axis=-1), passes)


def _residual_scores(
    logits: Float[Array, "num_rows vocab_size"],
    draft: Int[Array, " num_rows"],
    q: Float[Array, "num_rows vocab_size"] | None,
) -> Float[Array, "num_rows vocab_size"]:
    """Log-weights, up to a per-row constant, of the residual ``max(p - q, 0)``.

    With q one-hot at the draft that residual is p without the draft token, so
    the logits with the draft masked out serve, without a softmax.
    """
    if q is None:
        return jnp.where(jnp.arange(logits.shape[-1]) == draft[:, None], -jnp.inf, logits)
    return jnp.log(jnp.maximum(jax.nn.softmax(logits, axis=-1) - q, 0.0))


def rejection_sample(
    target_logits: Float[Array, "num_rows num_spec_plus_1 vocab_size"],
    draft_tokens: Int[Array, "num_rows num_spec"],
    num_drafts: Int[Array, " num_rows"],
    draft_probs: Float[Array, "num_rows num_spec vocab_size"] | None,
    is_greedy: Bool[Array, " num_rows"],
    seed_lo: UInt32[Array, " num_rows"],
    seed_hi: UInt32[Array, " num_rows"],
    positions: Int[Array, "num_rows num_spec_plus_1"],
) -> tuple[Int[Array, "num_rows num_spec_plus_1"], Int[Array, " num_rows"]]:
    """Verify each request's first ``num_drafts`` drafts; return its output tokens and count.

    ``target_logits`` row j scores the token after draft j - 1 (row 0: after
    the last accepted token), already through the sampling pipeline and divided
    by temperature (random rows), masked tokens at -inf; K1 = K + 1, K >= 1.
    ``draft_probs`` None means one-hot q at each draft (n-gram or greedy
    drafts). ``positions[r, j]`` is the position of row j's input token and
    keys that row's random numbers. Returns the accepted drafts followed by the
    recovered or bonus token, -1 after them, and their number (accepted + 1).
    """
    num_requests, k1, vocab = target_logits.shape
    k = k1 - 1
    logits = target_logits.astype(jnp.float32)
    q = None if draft_probs is None else draft_probs.astype(jnp.float32)
    drafts = jnp.clip(draft_tokens, 0, vocab - 1).astype(jnp.int32)
    positions = positions.astype(jnp.uint32)

    passes = _accepted(logits[:, :k], drafts, q, is_greedy, seed_lo, seed_hi, positions[:, :k])
    passes &= jnp.arange(k)[None, :] < num_drafts[:, None]
    num_accepted = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1)

    # The last emitted token comes from row ``num_accepted``: greedy rows take
    # its argmax; random rows sample the residual there if that row rejected
    # its draft, else (all drafts accepted) p itself.
    rows = jnp.arange(num_requests)
    last_logits = logits[rows, num_accepted]
    greedy_tokens = jnp.argmax(last_logits, axis=-1)

    def add_noise(_: None) -> Int[Array, " num_rows"]:
        rejected_at = jnp.minimum(num_accepted, k - 1)
        residual = _residual_scores(last_logits, drafts[rows, rejected_at], None if q is None else q[rows, rejected_at])
        # p == q up to rounding can leave no residual mass: sample from p then.
        residual = jnp.where(jnp.isfinite(residual).any(axis=-1, keepdims=True), residual, last_logits)
        scores = jnp.where((num_accepted < num_drafts)[:, None], residual, last_logits)
        vocab_ids = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
        hashes = murmur3_hash32(seed_lo[:, None], seed_hi[:, None], positions[rows, num_accepted][:, None], vocab_ids)
        return jnp.where(is_greedy, greedy_tokens, jnp.argmax(scores + gumbel_from_hash(hashes), axis=-1))

    last_token = jax.lax.cond(jnp.any(~is_greedy), add_noise, lambda _: greedy_tokens, None)

    column = jnp.arange(k1)[None, :]
    accepted = jnp.pad(draft_tokens.astype(jnp.int32), ((0, 0), (0, 1)))
    out = jnp.where(column < num_accepted[:, None], accepted, -1)
    out = jnp.where(column == num_accepted[:, None], last_token[:, None].astype(jnp.int32), out)
    return out, (num_accepted + 1).astype(jnp.int32)
