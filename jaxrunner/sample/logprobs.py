"""Logprobs of the sampled (or given) token, its rank, and the top-n, in float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogprobsTensors:
    """Per row: column 0 is the chosen token, columns 1.. the top-``max_logprobs``."""

    token_ids: Int[Array, "num_rows max_logprobs_plus_1"]
    logprobs: Float[Array, "num_rows max_logprobs_plus_1"]
    ranks: Int[Array, " num_rows"]  # how many tokens score >= the chosen one


def compute_logprobs(
    values: Float[Array, "num_rows vocab_size"],
    chosen: Int[Array, " num_rows"],
    num_logprobs: Int[Array, " num_rows"],
    max_logprobs: int,
    normalize: bool = True,
) -> LogprobsTensors:
    """Log-softmax (or the values as they are) of ``chosen`` and of the top tokens.

    Skipped (zeros) when no row asks for logprobs; rows asking for fewer than
    ``max_logprobs`` get them all and the host keeps what each asked for.
    """
    n = values.shape[0]

    def compute(_: None) -> LogprobsTensors:
        scores = jax.nn.log_softmax(values, axis=-1) if normalize else values
        top_scores, top_ids = jax.lax.top_k(scores, max_logprobs)
        chosen_score = jnp.take_along_axis(scores, chosen[:, None], axis=-1)
        ranks = jnp.sum(scores >= chosen_score, axis=-1, dtype=jnp.int32)
        return LogprobsTensors(
            token_ids=jnp.concatenate([chosen[:, None], top_ids.astype(jnp.int32)], axis=1),
            logprobs=jnp.concatenate([chosen_score, top_scores], axis=1),
            ranks=ranks,
        )

    return jax.lax.cond(jnp.any(num_logprobs > 0), compute, lambda _: no_logprobs(n, max_logprobs), None)


def no_logprobs(n: int, max_logprobs: int) -> LogprobsTensors:
    """Zeros in the shape of ``compute_logprobs``'s result: what a batch that asks for none returns."""
    return LogprobsTensors(
        token_ids=jnp.zeros((n, max_logprobs + 1), jnp.int32),
        logprobs=jnp.zeros((n, max_logprobs + 1), jnp.float32),
        ranks=jnp.zeros(n, jnp.int32),
    )
