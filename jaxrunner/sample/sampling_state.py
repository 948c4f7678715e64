"""Per-request sampling state on the device, written when requests join.

One slot per request: the scalar parameters, fixed-capacity lists (logit bias,
stop ids for min_tokens, bad words), the allowed-token bitmask, and for the
penalties the prompt's token set and the output token counts, which the step
itself updates after every sampled token.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from jaxrunner.config import SamplerConfig
from jaxrunner.interfaces import SamplingParams
from jaxrunner.sample.bitmask import num_words as bitmask_words
from jaxrunner.sample.bitmask import pack_bool_rows, pack_token_ids
from jaxrunner.sample.gumbel import split_seed

SamplingFields = dict[str, float | np.ndarray]
"""One request's sampling parameters packed for the device, by field name (``sampling_fields``)."""


def sampling_fields(config: SamplerConfig, vocab_size: int) -> tuple[tuple[str, int, str], ...]:
    """The packed-row fields of one request's sampling parameters."""
    return (
        ("temperature", 1, "f32"),
        ("top_k", 1, "i32"),
        ("top_p", 1, "f32"),
        ("min_p", 1, "f32"),
        ("seed_lo", 1, "u32"),
        ("seed_hi", 1, "u32"),
        ("repetition", 1, "f32"),
        ("frequency", 1, "f32"),
        ("presence", 1, "f32"),
        ("min_tokens", 1, "i32"),
        ("stop_ids", config.max_stop_token_ids, "i32"),
        ("bias_ids", config.max_logit_bias, "i32"),
        ("bias_values", config.max_logit_bias, "f32"),
        ("bad_words", config.max_bad_words * config.max_bad_word_len, "i32"),
        ("has_allowed", 1, "i32"),
        ("allowed", bitmask_words(vocab_size), "i32"),
        ("num_logprobs", 1, "i32"),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Sampling state, one row per request slot. Greedy rows have temperature 0."""

    temperature: Float[Array, " max_reqs"]
    top_k: Int[Array, " max_reqs"]
    top_p: Float[Array, " max_reqs"]
    min_p: Float[Array, " max_reqs"]
    seed_lo: UInt32[Array, " max_reqs"]
    seed_hi: UInt32[Array, " max_reqs"]
    repetition: Float[Array, " max_reqs"]
    frequency: Float[Array, " max_reqs"]
    presence: Float[Array, " max_reqs"]
    min_tokens: Int[Array, " max_reqs"]
    stop_ids: Int[Array, "max_reqs max_stop_token_ids"]
    bias_ids: Int[Array, "max_reqs max_logit_bias"]
    bias_values: Float[Array, "max_reqs max_logit_bias"]
    bad_words: Int[Array, "max_reqs max_bad_words max_bad_word_len"]
    has_allowed: Bool[Array, " max_reqs"]
    allowed: Int[Array, "max_reqs bitmask_words"]
    num_logprobs: Int[Array, " max_reqs"]  # 0: none, else 1 + top logprobs asked for
    prompt_len: Int[Array, " max_reqs"]
    prompt_bitmask: Int[Array, "max_reqs bitmask_words"]
    output_counts: Int[Array, "max_reqs vocab_size"]

    @classmethod
    def zeros(cls, max_num_reqs: int, config: SamplerConfig, vocab_size: int) -> SamplingArrays:
        """State for ``max_num_reqs`` slots, all unused."""
        r, w = max_num_reqs, bitmask_words(vocab_size)
        f32 = lambda *shape: jnp.zeros((r, *shape), jnp.float32)
        i32 = lambda *shape: jnp.zeros((r, *shape), jnp.int32)
        return cls(
            temperature=f32(),
            top_k=i32(),
            top_p=f32() + 1,
            min_p=f32(),
            seed_lo=jnp.zeros(r, jnp.uint32),
            seed_hi=jnp.zeros(r, jnp.uint32),
            repetition=f32() + 1,
            frequency=f32(),
            presence=f32(),
            min_tokens=i32(),
            stop_ids=i32(config.max_stop_token_ids) - 1,
            bias_ids=i32(config.max_logit_bias) - 1,
            bias_values=f32(config.max_logit_bias),
            bad_words=i32(config.max_bad_words, config.max_bad_word_len) - 1,
            has_allowed=jnp.zeros(r, jnp.bool_),
            allowed=i32(w),
            num_logprobs=i32(),
            prompt_len=i32(),
            prompt_bitmask=i32(w),
            output_counts=i32(vocab_size),
        )

    def write_rows(
        self,
        slots: Int[Array, " num_new_reqs"],
        fields: dict[str, Array],
        tokens: Int[Array, "num_new_reqs max_model_len"],
        prompt_len: Int[Array, " num_new_reqs"],
        prefill_len: Int[Array, " num_new_reqs"],
    ) -> SamplingArrays:
        """Scatter new requests' parameters into ``slots`` (out of range: dropped).

        The prompt's token set and the counts of tokens after the prompt (the
        outputs a resumed request already has) are built from its tokens,
        only when some new request uses a penalty.
        """
        scalar = lambda name: fields[name][:, 0]
        set_rows = lambda old, new: old.at[slots].set(new.astype(old.dtype), mode="drop")
        vocab = self.output_counts.shape[1]
        penalized = (scalar("repetition") != 1.0) | (scalar("frequency") != 0.0) | (scalar("presence") != 0.0)

        def token_sets(_):
            pos = jnp.arange(tokens.shape[1])[None, :]
            rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
            in_prompt = (pos < prompt_len[:, None]) & penalized[:, None]
            in_output = (pos >= prompt_len[:, None]) & (pos < prefill_len[:, None]) & penalized[:, None]
            seen = jnp.zeros((tokens.shape[0], vocab), jnp.bool_).at[rows, tokens].max(in_prompt)
            counts = jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[rows, tokens].add(in_output.astype(jnp.int32))
            return pack_bool_rows(seen), counts

        def no_sets(_):
            n = tokens.shape[0]
            return jnp.zeros((n, self.prompt_bitmask.shape[1]), jnp.int32), jnp.zeros((n, vocab), jnp.int32)

        prompt_bitmask, counts = jax.lax.cond(jnp.any(penalized), token_sets, no_sets, None)
        n = slots.shape[0]
        return SamplingArrays(
            temperature=set_rows(self.temperature, scalar("temperature")),
            top_k=set_rows(self.top_k, scalar("top_k")),
            top_p=set_rows(self.top_p, scalar("top_p")),
            min_p=set_rows(self.min_p, scalar("min_p")),
            seed_lo=set_rows(self.seed_lo, scalar("seed_lo")),
            seed_hi=set_rows(self.seed_hi, scalar("seed_hi")),
            repetition=set_rows(self.repetition, scalar("repetition")),
            frequency=set_rows(self.frequency, scalar("frequency")),
            presence=set_rows(self.presence, scalar("presence")),
            min_tokens=set_rows(self.min_tokens, scalar("min_tokens")),
            stop_ids=set_rows(self.stop_ids, fields["stop_ids"]),
            bias_ids=set_rows(self.bias_ids, fields["bias_ids"]),
            bias_values=set_rows(self.bias_values, fields["bias_values"]),
            bad_words=set_rows(self.bad_words, fields["bad_words"].reshape(n, *self.bad_words.shape[1:])),
            has_allowed=set_rows(self.has_allowed, scalar("has_allowed") != 0),
            allowed=set_rows(self.allowed, fields["allowed"]),
            num_logprobs=set_rows(self.num_logprobs, scalar("num_logprobs")),
            prompt_len=set_rows(self.prompt_len, prompt_len),
            prompt_bitmask=set_rows(self.prompt_bitmask, prompt_bitmask),
            output_counts=set_rows(self.output_counts, counts),
        )

    def record_sampled(
        self, slots: Int[Array, " num_rows"], tokens: Int[Array, " num_rows"], is_sampling: Bool[Array, " num_rows"]
    ) -> SamplingArrays:
        """Count each sampled token for the frequency and presence penalties."""
        rows = jnp.where(is_sampling, slots, self.output_counts.shape[0])
        counts = self.output_counts.at[rows, tokens].add(1, mode="drop")
        return dataclasses.replace(self, output_counts=counts)


def pack_sampling_params(
    params: SamplingParams, rng: random.Random, config: SamplerConfig, vocab_size: int
) -> SamplingFields:
    """Host-side field values of one request; checks the fixed capacities."""
    seed = params.seed if params.seed is not None else rng.getrandbits(64)
    lo, hi = split_seed(seed)
    greedy = params.greedy
    stop_ids = list(params.all_stop_token_ids if params.all_stop_token_ids is not None else params.stop_token_ids or [])
    bias = dict(params.logit_bias or {})
    bad_words = [list(w) for w in (params.bad_words_token_ids or [])]
    _check_capacity("stop token ids (min_tokens)", len(stop_ids), config.max_stop_token_ids, "max_stop_token_ids")
    _check_capacity("logit_bias entries", len(bias), config.max_logit_bias, "max_logit_bias")
    _check_capacity("bad words", len(bad_words), config.max_bad_words, "max_bad_words")
    longest = max((len(w) for w in bad_words), default=0)
    _check_capacity("tokens in a bad word", longest, config.max_bad_word_len, "max_bad_word_len")
    check_logprobs_count("logprobs", params.logprobs, config)
    for token in [*stop_ids, *bias, *(t for w in bad_words for t in w), *(params.allowed_token_ids or [])]:
        if not 0 <= int(token) < vocab_size:
            raise ValueError(
                f"Token id {token} in the sampling parameters is outside the vocabulary [0, {vocab_size})."
            )
    bad = np.full((config.max_bad_words, config.max_bad_word_len), -1, np.int32)
    for i, word in enumerate(bad_words):
        if word:
            bad[i, config.max_bad_word_len - len(word) :] = word
    allowed = params.allowed_token_ids
    if allowed is not None and not allowed:
        raise ValueError("SamplingParams.allowed_token_ids is empty; allow at least one token or pass None.")
    return {
        "temperature": 0.0 if greedy else params.temperature,
        "top_k": 0 if greedy else params.top_k,
        "top_p": 1.0 if greedy else params.top_p,
        "min_p": 0.0 if greedy else params.min_p,
        "seed_lo": lo,
        "seed_hi": hi,
        "repetition": params.repetition_penalty,
        "frequency": params.frequency_penalty,
        "presence": params.presence_penalty,
        "min_tokens": params.min_tokens,
        "stop_ids": np.array(stop_ids + [-1] * (config.max_stop_token_ids - len(stop_ids)), np.int32),
        "bias_ids": np.array(list(bias) + [-1] * (config.max_logit_bias - len(bias)), np.int32),
        "bias_values": np.array(list(bias.values()), np.float32),
        "bad_words": bad,
        "has_allowed": int(allowed is not None),
        "allowed": pack_token_ids(allowed, vocab_size) if allowed is not None else np.zeros(0, np.int32),
        # 0: no logprobs; otherwise 1 + the number of top logprobs asked for.
        "num_logprobs": 0 if params.logprobs is None else params.logprobs + 1,
    }


def uses_sampling_stages(fields: SamplingFields) -> bool:
    """Whether a request's packed parameters (``pack_sampling_params``) turn on any stage before the draw.

    The host's reading of the predicates the sampling program tests on the
    device: allowed tokens, logit bias, min_tokens, the penalties, bad words,
    and on random rows min_p, top-k and top-p. Wherever float32 rounding could
    make the two disagree, it says yes (the stages then run and do nothing).
    """
    random_row = fields["temperature"] > 0
    return bool(
        fields["has_allowed"]
        or np.any(fields["bias_ids"] >= 0)
        or fields["min_tokens"] > 0
        or fields["repetition"] != 1.0
        or fields["frequency"] != 0.0
        or fields["presence"] != 0.0
        or np.any(fields["bad_words"] >= 0)
        or (random_row and (fields["min_p"] > 0 or fields["top_k"] > 0 or fields["top_p"] < 1.0))
    )


def check_logprobs_count(field: str, count: int | None, config: SamplerConfig) -> None:
    """Raise ValueError if ``count`` (of the SamplingParams field ``field``) is past ``max_logprobs``."""
    if count is not None and (count == -1 or count > config.max_logprobs):
        raise ValueError(
            f"SamplingParams.{field} asks for {count}; this engine returns at most "
            f"{config.max_logprobs} (SamplerConfig.max_logprobs)."
        )


def _check_capacity(what: str, count: int, cap: int, field: str) -> None:
    if count > cap:
        raise ValueError(f"A request has {count} {what}; at most {cap} fit (SamplerConfig.{field}).")
