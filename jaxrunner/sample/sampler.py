"""The sampling step, in vLLM's order, inside the jitted request-bucketed program.

logits (float32) -> allowed_token_ids, grammar bitmask -> logit_bias ->
min_tokens -> repetition / frequency / presence penalties -> bad words ->
[greedy rows: argmax] temperature -> min_p -> top-k, top-p -> seeded Gumbel
argmax. Every stage runs under ``lax.cond`` on whether any row of the batch
uses it, so features a batch does not use cost one reduction over its flags.
On a GPU each conditional copies its predicate to the host, and the thread
that launches the kernels waits for it. So a batch whose requests use none of
the stages and ask for no logprobs takes the plain path (``plain=True``, chosen
on the host from the requests' parameters, as vLLM's sampler checks
``all_greedy`` and ``no_penalties``): temperature and the Gumbel draw alone,
with no conditional.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.sample.bitmask import apply_token_bitmask
from jaxrunner.sample.gumbel import gumbel_from_hash, murmur3_hash32
from jaxrunner.sample.logits_processors import (
    apply_bad_words,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
)
from jaxrunner.sample.logprobs import LogprobsTensors, compute_logprobs, no_logprobs
from jaxrunner.sample.sampling_state import SamplingArrays
from jaxrunner.sample.top_k_top_p import apply_top_k_top_p

Logits = Float[Array, "num_rows vocab_size"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    """What the sampling step returns: one token per row and its logprobs."""

    sampled_token_ids: Int[Array, " num_rows"]
    logprobs: LogprobsTensors


def _when(flag: Bool[Array, ""], stage: Callable[[Logits], Logits], logits: Logits) -> Logits:
    return jax.lax.cond(flag, stage, lambda x: x, logits)


# What a padding row (slot out of range) reads: values that turn no stage on; zeros elsewhere.
_NEUTRAL_FILL = {"top_p": 1, "repetition": 1, "stop_ids": -1, "bias_ids": -1, "bad_words": -1}


def _rows(sampling: SamplingArrays, idx: Int[Array, " num_rows"]) -> SamplingArrays:
    """The batch's rows of every sampling array; padding rows are greedy and neutral."""
    return SamplingArrays(
        **{
            field.name: getattr(sampling, field.name)
            .at[idx]
            .get(mode="fill", fill_value=_NEUTRAL_FILL.get(field.name, 0))
            for field in dataclasses.fields(sampling)
        }
    )


def _history(
    token_ids: Int[Array, "max_reqs max_model_len"],
    idx: Int[Array, " num_rows"],
    positions: Int[Array, " num_rows"],
    length: int,
):
    """The ``length`` tokens up to and including each row's last input token; -1 before position 0."""
    pos = positions[:, None] - jnp.arange(length - 1, -1, -1)[None, :]
    tokens = token_ids.at[idx[:, None], jnp.maximum(pos, 0)].get(mode="fill", fill_value=-1)
    return jnp.where(pos >= 0, tokens, -1)


def stage_rows(s: SamplingArrays, positions: Int[Array, " num_rows"]) -> dict[str, Bool[Array, " num_rows"]]:
    """Per stage before the draw (the grammar's aside), the rows it acts on; a stage runs when any does.

    ``uses_sampling_stages`` is the host's reading of the same predicates.
    """
    random_rows = s.temperature > 0.0
    # Tokens generated before this one: the row predicts position ``positions + 1``.
    generated = positions + 1 - s.prompt_len
    return {
        "allowed_token_ids": s.has_allowed,
        "logit_bias": jnp.any(s.bias_ids >= 0, axis=-1),
        "min_tokens": generated < s.min_tokens,
        "penalties": (s.repetition != 1.0) | (s.frequency != 0.0) | (s.presence != 0.0),
        "bad_words": jnp.any(s.bad_words >= 0, axis=(-2, -1)),
        "min_p": random_rows & (s.min_p > 0),
        "top_k_top_p": random_rows & ((s.top_k > 0) | (s.top_p < 1.0)),
    }


def process_logits(
    logits: Logits,
    s: SamplingArrays,
    rows: dict[str, Bool[Array, " num_rows"]],
    history: Int[Array, "num_rows history_len"],
    grammar_bitmask: Int[Array, "num_rows bitmask_words"],
    grammar_active: Bool[Array, " num_rows"],
    ahead: Int[Array, "num_rows num_ahead"] | None = None,
) -> Logits:
    """The stages before temperature; ``s`` holds the batch's rows, ``rows`` is ``stage_rows(s, ...)``.

    ``ahead`` lists, per row, output tokens not in ``s.output_counts`` yet (-1 pads):
    a verified draft row's drafts before it, which the penalties count as generated.
    """
    logits = _when(
        jnp.any(rows["allowed_token_ids"]), lambda x: apply_token_bitmask(x, s.allowed, s.has_allowed), logits
    )
    logits = _when(jnp.any(grammar_active), lambda x: apply_token_bitmask(x, grammar_bitmask, grammar_active), logits)
    logits = _when(jnp.any(rows["logit_bias"]), lambda x: apply_logit_bias(x, s.bias_ids, s.bias_values), logits)
    logits = _when(jnp.any(rows["min_tokens"]), lambda x: apply_min_tokens(x, s.stop_ids, rows["min_tokens"]), logits)

    def penalize(x: Logits) -> Logits:
        counts = s.output_counts if ahead is None else count_tokens(s.output_counts, ahead)
        return apply_penalties(x, s.prompt_bitmask, counts, s.repetition, s.frequency, s.presence)

    logits = _when(jnp.any(rows["penalties"]), penalize, logits)
    return _when(jnp.any(rows["bad_words"]), lambda x: apply_bad_words(x, s.bad_words, history), logits)


def count_tokens(
    counts: Int[Array, "num_rows vocab_size"], tokens: Int[Array, "num_rows num_tokens"]
) -> Int[Array, "num_rows vocab_size"]:
    """``counts`` with each row's ``tokens`` (-1 pads) added."""
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    return counts.at[rows, jnp.where(tokens >= 0, tokens, counts.shape[1])].add(1, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PreparedLogits:
    """The stages before the draw: what sampling, rejection and logprobs read."""

    raw: Logits  # float32 model logits
    processed: Logits  # after the processors; greedy rows take its argmax
    tempered: Logits  # processed / temperature, min-p, top-k and top-p applied
    is_greedy: Bool[Array, " num_rows"]
    rows: SamplingArrays  # the batch's rows of the sampling state


def prepare_logits(
    logits: Logits,
    sampling: SamplingArrays,
    token_ids: Int[Array, "max_reqs max_model_len"],
    idx_mapping: Int[Array, " num_rows"],
    positions: Int[Array, " num_rows"],
    grammar_bitmask: Int[Array, "num_rows bitmask_words"],
    grammar_active: Bool[Array, " num_rows"],
    ahead: Int[Array, "num_rows num_ahead"] | None = None,
) -> PreparedLogits:
    """Row i uses the state of request slot ``idx_mapping[i]``; ``positions`` is its last input's.

    ``ahead``: per row, generated tokens the output counts do not hold yet (``process_logits``).
    """
    raw = logits.astype(jnp.float32)
    s = _rows(sampling, idx_mapping)
    history = _history(token_ids, idx_mapping, positions, s.bad_words.shape[-1] - 1)
    rows = stage_rows(s, positions)
    processed = process_logits(raw, s, rows, history, grammar_bitmask, grammar_active, ahead)
    is_greedy = s.temperature <= 0.0
    tempered = _temper(processed, is_greedy, s.temperature)
    tempered = _when(
        jnp.any(rows["min_p"]),
        lambda x: apply_min_p(x, jnp.where(rows["min_p"], s.min_p, 0.0)),
        tempered,
    )
    filters = rows["top_k_top_p"]
    tempered = _when(
        jnp.any(filters),
        lambda x: apply_top_k_top_p(x, jnp.where(filters, s.top_k, 0), jnp.where(filters, s.top_p, 1.0)),
        tempered,
    )
    return PreparedLogits(raw, processed, tempered, is_greedy, s)


def _temper(logits: Logits, is_greedy: Bool[Array, " num_rows"], temperature: Float[Array, " num_rows"]) -> Logits:
    return logits / jnp.where(is_greedy, 1.0, temperature)[:, None]


def plain_logits(logits: Logits, sampling: SamplingArrays, idx_mapping: Int[Array, " num_rows"]) -> PreparedLogits:
    """``prepare_logits`` for a batch that uses no stage before the draw: temperature alone."""
    raw = logits.astype(jnp.float32)
    s = _rows(sampling, idx_mapping)
    is_greedy = s.temperature <= 0.0
    return PreparedLogits(raw, raw, _temper(raw, is_greedy, s.temperature), is_greedy, s)


def draw(
    prepared: PreparedLogits, positions: Int[Array, " num_rows"], *, conditional: bool = True
) -> Int[Array, " num_rows"]:
    """Argmax for greedy rows; seeded Gumbel-max over the tempered logits for the others.

    The noise is computed only when some row is random (``conditional``), or
    for every row with no conditional.
    """
    s = prepared.rows
    greedy_tokens = jnp.argmax(prepared.processed, axis=-1)

    def add_noise(_: None) -> Int[Array, " num_rows"]:
        vocab_ids = jnp.arange(prepared.raw.shape[-1], dtype=jnp.uint32)[None, :]
        hashes = murmur3_hash32(
            s.seed_lo[:, None], s.seed_hi[:, None], positions.astype(jnp.uint32)[:, None], vocab_ids
        )
        noisy = jnp.argmax(prepared.tempered + gumbel_from_hash(hashes), axis=-1)
        return jnp.where(prepared.is_greedy, greedy_tokens, noisy)

    if not conditional:
        return add_noise(None).astype(jnp.int32)
    any_random = jnp.any(~prepared.is_greedy)
    return jax.lax.cond(any_random, add_noise, lambda _: greedy_tokens, None).astype(jnp.int32)


def sample(
    logits: Logits,
    sampling: SamplingArrays,
    token_ids: Int[Array, "max_reqs max_model_len"],
    idx_mapping: Int[Array, " num_rows"],
    positions: Int[Array, " num_rows"],
    grammar_bitmask: Int[Array, "num_rows bitmask_words"] | None,
    grammar_active: Bool[Array, " num_rows"] | None,
    *,
    max_logprobs: int,
    logprobs_mode: str,
    plain: bool = False,
) -> SamplerOutput:
    """One token per row, and the logprobs the rows asked for.

    ``plain``: no request of the batch uses a stage before the draw or asks for
    logprobs (the caller's promise), so none is applied and the logprobs are
    zeros. The tokens are the full path's: every stage works row by row and
    leaves a row with neutral parameters unchanged, and the tokens of rows that
    do not sample (padding, a prefill chunk before its last) are dropped.
    The grammar arguments may be None on the plain path only, which applies no grammar.
    """
    if plain:
        tokens = draw(plain_logits(logits, sampling, idx_mapping), positions, conditional=False)
        return SamplerOutput(tokens, no_logprobs(logits.shape[0], max_logprobs))
    assert grammar_bitmask is not None and grammar_active is not None, "the full path applies the grammar"
    prepared = prepare_logits(logits, sampling, token_ids, idx_mapping, positions, grammar_bitmask, grammar_active)
    tokens = draw(prepared, positions)
    return SamplerOutput(tokens, logprobs_of(prepared, tokens, max_logprobs, logprobs_mode))


def logprobs_of(
    prepared: PreparedLogits, tokens: Int[Array, " num_rows"], max_logprobs: int, logprobs_mode: str
) -> LogprobsTensors:
    """The logprobs (vLLM's ``logprobs_mode``) of ``tokens`` and the top ``max_logprobs``, per row:
    of the raw logits or of the distribution drawn from, normalized or as logits."""
    source = prepared.raw if logprobs_mode.startswith("raw") else prepared.tempered
    return compute_logprobs(
        source, tokens, prepared.rows.num_logprobs, max_logprobs, normalize=logprobs_mode.endswith("logprobs")
    )
