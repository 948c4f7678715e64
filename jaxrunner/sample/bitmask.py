"""Token bitmasks: bit ``v % 32`` of int32 word ``v // 32`` set = token ``v`` allowed.

The same layout serves allowed_token_ids and structured-output grammar masks
(xgrammar's), so one device function applies both.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


def num_words(vocab_size: int) -> int:
    """Words in a bitmask over ``vocab_size`` tokens: ceil(V / 32)."""
    return -(-vocab_size // 32)


def apply_token_bitmask(
    logits: Float[Array, "num_rows vocab_size"],
    bitmask: Int[Array, "num_rows bitmask_words"],
    active: Bool[Array, " num_rows"],
) -> Float[Array, "num_rows vocab_size"]:
    """Set to -inf the logits of tokens whose bit is cleared, in active rows only.

    Bits past V (the last word's padding) are ignored; inactive rows are untouched.
    """
    allowed = bitmask_to_bool(bitmask, logits.shape[-1])
    return jnp.where(active[:, None] & ~allowed, -jnp.inf, logits)


def bitmask_to_bool(
    bitmask: Int[Array, "num_rows bitmask_words"], vocab_size: int
) -> Bool[Array, "num_rows vocab_size"]:
    """Device side: the set bits as a boolean mask over the first ``vocab_size`` tokens."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # & 1: sign-safe
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def pack_token_ids(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """Host side: the int32[ceil(V/32)] bitmask with exactly ``token_ids`` set."""
    ids = np.asarray(list(token_ids), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    bits = np.zeros(num_words(vocab_size) * 32, dtype=np.uint32)
    bits[ids] = 1
    words = np.bitwise_or.reduce(bits.reshape(-1, 32) << np.arange(32, dtype=np.uint32), axis=1)
    return words.astype(np.uint32).view(np.int32)


def pack_bool_rows(mask: Bool[Array, "num_rows vocab_size"]) -> Int[Array, "num_rows bitmask_words"]:
    """Bit ``v % 32`` of word ``v // 32`` set where ``mask[:, v]``."""
    n, vocab = mask.shape
    words = num_words(vocab)
    padded = jnp.pad(mask, ((0, 0), (0, words * 32 - vocab))).reshape(n, words, 32)
    bits = padded.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)
