"""Per-row logits processors with vLLM semantics, as pure jittable functions.

Each takes a batch of rows (one request's float32 logits each) and per-row
parameters already gathered into arrays. Rows with neutral parameters (-1
padding, penalty 1 / 0, min_p 0) come back bit-identical, so requests that use
a feature can share a batch with requests that do not. Order in the sampler
(vLLM's): bitmask / logit bias / min_tokens, penalties, bad words,
temperature, min_p, top-k / top-p.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.sample.bitmask import bitmask_to_bool


def _scatter_index(
    token_ids: Int[Array, "num_rows num_ids"], vocab_size: int, keep: Bool[Array, " num_rows #num_ids"] | bool = True
) -> tuple[Int[Array, "num_rows num_ids"], Int[Array, "num_rows num_ids"]]:
    """(row, column) indices for a per-row scatter; padding (-1) and ``~keep`` go to
    column V, which ``mode="drop"`` discards (a plain -1 would wrap to V - 1)."""
    rows = jnp.broadcast_to(jnp.arange(token_ids.shape[0])[:, None], token_ids.shape)
    cols = jnp.where(keep & (token_ids >= 0), token_ids, vocab_size)
    return rows, cols


def apply_logit_bias(
    logits: Float[Array, "num_rows vocab_size"],
    token_ids: Int[Array, "num_rows max_logit_bias"],
    values: Float[Array, "num_rows max_logit_bias"],
) -> Float[Array, "num_rows vocab_size"]:
    """Add ``values[i, j]`` to ``logits[i, token_ids[i, j]]``; id -1 is padding, duplicates add."""
    rows, cols = _scatter_index(token_ids, logits.shape[-1])
    return logits.at[rows, cols].add(values, mode="drop")


def apply_min_tokens(
    logits: Float[Array, "num_rows vocab_size"],
    stop_token_ids: Int[Array, "num_rows max_stop_token_ids"],
    active: Bool[Array, " num_rows"],
) -> Float[Array, "num_rows vocab_size"]:
    """Ban the stop tokens (-1 padding) of active rows: those with generated < min_tokens."""
    rows, cols = _scatter_index(stop_token_ids, logits.shape[-1], active[:, None])
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def apply_penalties(
    logits: Float[Array, "num_rows vocab_size"],
    prompt_bitmask: Int[Array, "num_rows bitmask_words"],
    output_counts: Int[Array, "num_rows vocab_size"],
    repetition: Float[Array, " num_rows"],
    frequency: Float[Array, " num_rows"],
    presence: Float[Array, " num_rows"],
) -> Float[Array, "num_rows vocab_size"]:
    """Repetition, then frequency, then presence penalty (vLLM order and formulas).

    Repetition covers tokens seen in the prompt or the output: positive logits
    are divided by r, the others multiplied by r. Frequency and presence count
    output tokens only. r = 1, f = p = 0 is exact arithmetic identity.
    """
    seen = bitmask_to_bool(prompt_bitmask, logits.shape[-1]) | (output_counts > 0)
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency[:, None] * output_counts.astype(logits.dtype)
    return logits - presence[:, None] * (output_counts > 0).astype(logits.dtype)


def apply_bad_words(
    logits: Float[Array, "num_rows vocab_size"],
    bad_words: Int[Array, "num_rows max_bad_words max_bad_word_len"],
    history: Int[Array, "num_rows max_bad_word_len-1"],
) -> Float[Array, "num_rows vocab_size"]:
    """Ban the last token of every bad word whose other tokens end the history.

    Bad words are left-padded with -1 to length L (an all -1 word is unused);
    ``history`` holds the row's last L - 1 tokens, left-padded with -1. Both are
    right-aligned, so word position j < L - 1 faces history position j, and a
    word matches when each of its real tokens equals the history token facing
    it (a history pad never equals a real token: too short a history never
    matches). Cost O(n * B * L) plus one scatter of n * B.
    """
    prefix, last = bad_words[:, :, :-1], bad_words[:, :, -1]
    facing = history[:, None, :]
    matches = jnp.all((prefix < 0) | (prefix == facing), axis=-1)
    rows, cols = _scatter_index(last, logits.shape[-1], matches)
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def apply_min_p(
    logits: Float[Array, "num_rows vocab_size"], min_p: Float[Array, " num_rows"]
) -> Float[Array, "num_rows vocab_size"]:
    """On tempered logits, ban tokens with logit < max + log(min_p), i.e. with
    probability below min_p times the largest one. min_p 0 is off."""
    threshold = jnp.max(logits, axis=-1) + jnp.log(min_p)
    ban = (min_p > 0)[:, None] & (logits < threshold[:, None])
    return jnp.where(ban, -jnp.inf, logits)
