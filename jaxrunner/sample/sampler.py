"""Token sampling inside the jitted, request-bucketed step.

Greedy rows take the argmax. Random rows add seeded Gumbel noise to the
tempered logits, after masking outside top-k and top-p, and take the argmax:
the Gumbel-max trick samples exactly from softmax(logits / T) over the kept set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.sample.gumbel import gumbel_from_hash, murmur3_hash32
from jaxrunner.sample.sampling_state import SamplingArrays


def apply_top_k_top_p(
    logits: Float[Array, "n vocab"],
    top_k: Int[Array, "n"],
    top_p: Float[Array, "n"],
) -> Float[Array, "n vocab"]:
    """Mask (to -inf) tokens outside the top-k, then outside the top-p nucleus.

    top_k 0 and top_p 1 keep everything. Ties at a cut-off are kept. The nucleus
    is the smallest set of most likely tokens whose probability reaches top_p.
    """
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = mass_before < top_p[:, None]
    in_nucleus = in_nucleus.at[:, 0].set(True)
    num_kept = jnp.sum(in_nucleus, axis=-1)
    cutoff = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)
    cutoff = jnp.maximum(cutoff, kth)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample_tokens(
    logits: Float[Array, "n vocab"],
    sampling: SamplingArrays,
    idx_mapping: Int[Array, "n"],
    positions: Int[Array, "n"],
) -> Int[Array, "n"]:
    """One token per row; row i uses the parameters of request slot ``idx_mapping[i]``.

    ``positions`` is the position of the token being predicted's input (the
    seeded noise is a function of (seed, position, token id)).
    """
    logits = logits.astype(jnp.float32)
    take = lambda a, fill: jnp.take(a, idx_mapping, mode="fill", fill_value=fill)
    temperature = take(sampling.temperature, 0.0)
    top_k = take(sampling.top_k, 0)
    top_p = take(sampling.top_p, 1.0)
    is_greedy: Bool[Array, "n"] = temperature <= 0.0
    greedy_tokens = jnp.argmax(logits, axis=-1)

    def sample_random(_: None) -> Int[Array, "n"]:
        tempered = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]
        needs_filter = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~is_greedy)
        tempered = jax.lax.cond(
            needs_filter, apply_top_k_top_p, lambda x, *_: x, tempered, top_k, top_p
        )
        vocab_ids = jnp.arange(logits.shape[-1], dtype=jnp.uint32)[None, :]
        hashes = murmur3_hash32(
            take(sampling.seed_lo, 0)[:, None],
            take(sampling.seed_hi, 0)[:, None],
            positions.astype(jnp.uint32)[:, None],
            vocab_ids,
        )
        noisy = jnp.argmax(tempered + gumbel_from_hash(hashes), axis=-1)
        return jnp.where(is_greedy, greedy_tokens, noisy)

    # An all-greedy batch never computes the noise.
    tokens = jax.lax.cond(
        jnp.all(is_greedy), lambda _: greedy_tokens, sample_random, None
    )
    return tokens.astype(jnp.int32)
