"""What ``LLM.generate`` returns, with vLLM's names."""

from __future__ import annotations

import dataclasses

from jaxrunner.lora.request import LoRARequest


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request, in seconds since the monotonic clock's origin."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token, once there is one."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean latency of the tokens after the first (TPOT)."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclasses.dataclass
class Logprob:
    """A token's log probability, its rank among all tokens, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the chosen token and the top-n, by token id.
SampleLogprobs = list[dict[int, Logprob]]


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """Whether this sequence has finished (it has a finish reason)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A prompt and what was generated for it. ``error`` says why a bad request was refused."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # None for the first prompt token, then one dict per prompt position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: LoRARequest | None = None
    """The adapter the prompt ran with (None: the base model)."""
