"""The runner's contract, with vLLM's names and fields.

A scheduler hands the runner a ``SchedulerOutput`` each step; the runner answers
with a ``ModelRunnerOutput``. ``SamplingParams`` follows vLLM's semantics and
validates itself, so a bad value fails at the request, not inside a step.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from typing import Any

import numpy as np
from jaxtyping import Float, Int

from jaxrunner import envs

# Below this temperature vLLM samples greedily and turns top-p/top-k/min-p off.
GREEDY_TEMPERATURE = 1e-5

_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_OPTIONAL_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling parameters with vLLM's names, defaults and checks.

    ``n`` (completions of the prompt) is at most ``JAXRUNNER_MAX_N_SEQUENCES``
    (16384 unless set), as vLLM's ``VLLM_MAX_N_SEQUENCES`` bounds it: each
    completion is a request of its own. vLLM's V1 dropped ``best_of``; it is
    refused here too (a ``TypeError``, an unknown argument).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: Any | None = None
    # Set by the engine from its tokenizer, as vLLM's update_from_tokenizer does:
    # EOS (unless ignore_eos) plus stop_token_ids, masked while generated < min_tokens,
    # and each bad word as token id sequences.
    all_stop_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self._check_number_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _check_number_types(self) -> None:
        """Integer fields take integers only (``n=2.0`` is refused, not truncated), float fields finite
        real numbers; NumPy scalars become Python numbers. Each error names the field."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"SamplingParams.{name} must be an integer; got {value!r}.")
            setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"SamplingParams.{name} must be a real number; got {value!r}.")
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be finite; got {value!r}.")
            setattr(self, name, float(value))
        if self.logit_bias is not None:
            bias = {}
            for token, value in dict(self.logit_bias).items():
                if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids; got {token!r}.")
                if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                    raise ValueError(f"SamplingParams.logit_bias[{token}] must be a real number; got {value!r}.")
                if not math.isfinite(value):
                    raise ValueError(f"SamplingParams.logit_bias[{token}] must be finite; got {value!r}.")
                bias[int(token)] = float(value)
            self.logit_bias = bias

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (vLLM: temperature < 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 or -1 (off) or a positive count"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be positive"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "must not exceed max_tokens",
            ),
            ("logprobs", self.logprobs is None or self.logprobs >= -1, "must be -1 or a count"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or self.prompt_logprobs >= -1,
                "must be -1 or a count",
            ),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []),
                "must be non-negative token ids",
            ),
            (
                "stop",
                all(isinstance(s, str) and s for s in self.stop or []),
                "must be non-empty strings",
            ),
            (
                "seed",
                self.seed is None or -(1 << 63) <= self.seed < (1 << 64),
                "must fit in 64 bits",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}; got {getattr(self, name)!r}.")
        max_n = envs.JAXRUNNER_MAX_N_SEQUENCES
        if self.n > max_n:
            raise ValueError(
                f"SamplingParams.n must be at most {max_n}; got {self.n}. "
                f"Set {envs.MAX_N_SEQUENCES_ENV_VAR} to raise the limit."
            )


@dataclasses.dataclass
class NewRequestData:
    """A request scheduled for the first time (or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # All tokens so far: the prompt, plus the outputs of a resumed request.
    prefill_token_ids: list[int] | None = None
    lora_request: Any | None = None
    mm_features: list[Any] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prefill_token_ids is None:
            self.prefill_token_ids = list(self.prompt_token_ids)


@dataclasses.dataclass
class CachedRequestData:
    """Requests already on the runner: their computed counts and new blocks."""

    req_ids: list[str] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)
    # One entry per request: per KV-cache group, the block ids appended this step.
    new_block_ids: list[tuple[list[int], ...] | None] = dataclasses.field(default_factory=list)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        """No cached requests."""
        return cls()


@dataclasses.dataclass
class SchedulerOutput:
    """What the scheduler decided for one step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    finished_req_ids: set[str] = dataclasses.field(default_factory=set)
    preempted_req_ids: set[str] | None = None
    free_encoder_mm_hashes: list[str] = dataclasses.field(default_factory=list)
    scheduled_encoder_inputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    kv_connector_metadata: Any = None
    """The KV connector's copies for this step (``KVConnectorMetadata``); None: none."""
    num_decode_steps: int = 1
    """Decode steps run back to back in this round (multi-step scheduling): each request's
    ``num_scheduled_tokens`` is this many steps of one token, and it samples one token per step."""

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        """A step that schedules nothing."""
        return cls(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
        )


@dataclasses.dataclass
class GrammarOutput:
    """Structured-output constraints: one int32 bitmask row per constrained request.

    Bit ``v % 32`` of word ``v // 32`` in a row allows token ``v``.
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: Int[np.ndarray, "num_structured_reqs bitmask_words"]  # int32; row i: request i above


@dataclasses.dataclass
class LogprobsLists:
    """Sample logprobs: per generated token, the sampled token first, then the top-n."""

    logprob_token_ids: Int[np.ndarray, "num_generated num_logprobs_plus_1"]  # int32
    logprobs: Float[np.ndarray, "num_generated num_logprobs_plus_1"]  # float32
    sampled_token_ranks: Int[np.ndarray, " num_generated"]  # int32
    cu_num_generated_tokens: list[int] | None = None


@dataclasses.dataclass
class ModelRunnerOutput:
    """What the runner returns for one step."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request: the tokens it produced this step (empty mid chunked prefill).
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    # Per request: (position of the first prompt token scored this step, its rows).
    prompt_logprobs_dict: dict[str, tuple[int, LogprobsLists]] = dataclasses.field(default_factory=dict)
    num_nans_in_logits: dict[str, int] | None = None

    @classmethod
    def make_empty(cls) -> ModelRunnerOutput:
        """The output of a step that ran nothing."""
        return cls(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class AsyncModelRunnerOutput(abc.ABC):
    """A step's output whose copy to the host may still be in flight (async scheduling)."""

    @abc.abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait for the step's results and return them."""


class RequestOutputKind(enum.Enum):
    """Which outputs a step returns, as vLLM's: the whole text so far, only what is
    new since the last output (streaming), or only finished requests."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
