"""N-gram prompt lookup on the device (vLLM's "ngram_gpu"): the host proposer's drafts, without the host.

The sampling program runs it after verification, over each request's history
in ``DeviceState.token_ids`` (the prompt, then every accepted token at its
position), so the next step's drafts wait on the device like a draft model's
and the step can be dispatched before the host has seen this one's tokens.
The match rule is ``jaxrunner.engine.ngram_proposer``'s, vectorised over the
requests: the longest suffix n-gram (``min_n`` to ``max_n`` tokens) that occurs
earlier in the history, its leftmost occurrence, and the tokens after it.
A request without a match, or with fewer following tokens than drafts, gets
-1 for the drafts it lacks; verification stops at the first.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int

NO_DRAFT = -1
"""A draft slot the proposer could not fill."""


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup of ``num_drafts`` tokens over suffix n-grams of ``min_n`` to ``max_n`` tokens."""

    num_drafts: int
    min_n: int
    max_n: int

    def propose(
        self,
        token_ids: Int[Array, "max_reqs max_model_len"],
        slots: Int[Array, " num_rows"],
        lengths: Int[Array, " num_rows"],
    ) -> Int[Array, "num_rows num_drafts"]:
        """Drafts after each row's history ``token_ids[slot, :length]``; ``NO_DRAFT`` where there is none.

        ``alive[r, e]`` says the window of row r ending at e (e <= length - 2, so a
        token follows it) matches the suffix over the last ``m + 1`` tokens; each
        longer ``m`` is one comparison of the history, shifted by ``m``, against one
        suffix token, as the host proposer does row by row.
        """
        history = token_ids.at[slots].get(mode="fill", fill_value=NO_DRAFT)
        max_model_len = history.shape[1]
        ends = jnp.arange(max_model_len)[None, :]
        alive = ends <= lengths[:, None] - 2
        best_end = jnp.full(slots.shape, -1, jnp.int32)
        best_n = jnp.zeros(slots.shape, jnp.int32)
        for m in range(self.max_n):
            suffix_token = jnp.take_along_axis(history, jnp.maximum(lengths - 1 - m, 0)[:, None], axis=1)
            shifted = jnp.pad(history, ((0, 0), (m, 0)), constant_values=NO_DRAFT)[:, :max_model_len]
            alive = alive & (ends >= m) & (shifted == suffix_token) & (m <= lengths - 2)[:, None]
            found = jnp.any(alive, axis=1)
            best_end = jnp.where(found, jnp.argmax(alive, axis=1).astype(jnp.int32), best_end)
            best_n = jnp.where(found, m + 1, best_n)
        offsets = jnp.arange(self.num_drafts)[None, :]
        source = best_end[:, None] + 1 + offsets
        valid = (
            (best_n >= self.min_n)[:, None]
            & (source <= lengths[:, None] - 1)
            & (lengths[:, None] + offsets < max_model_len)  # never past max_model_len, as on the host
        )
        drafts = jnp.take_along_axis(history, jnp.clip(source, 0, max_model_len - 1), axis=1)
        return jnp.where(valid, drafts, NO_DRAFT)


def num_valid_drafts(
    drafts: Int[Array, "num_rows num_spec"], num_scheduled_drafts: Int[Array, " num_rows"]
) -> Int[Array, " num_rows"]:
    """Drafts to verify per row: those scheduled, up to the first the proposer could not fill."""
    filled = jnp.cumprod((drafts != NO_DRAFT).astype(jnp.int32), axis=1).sum(axis=1)
    return jnp.minimum(filled, num_scheduled_drafts)
