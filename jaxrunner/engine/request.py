"""An engine request: its tokens, status and timing, as vLLM's ``Request``."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence

from jaxrunner.interfaces import SamplingParams
from jaxrunner.lora.request import LoRARequest
from jaxrunner.multimodal.inputs import MultiModalFeatureSpec


class RequestStatus(enum.Enum):
    """Where a request is in its life, as vLLM's; the finished ones carry the finish reason as value."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    # Members are singletons compared by identity: hash them by identity too, in C (Enum's
    # hash runs Python to hash the name, and ``is_finished`` is asked per request and step).
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        """Whether the status ends the request."""
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED}
)


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to generate. ``n > 1`` prompts become several of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # The token id or stop string that ended the request, if any.
    stop_reason: int | str | None = None
    # Draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Tokens sampled by steps already dispatched whose outputs have not come back
    # (async scheduling): the positions are scheduled, the ids not known yet.
    num_output_placeholders: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    # The request ends only at its length limit (no EOS, stop token, stop string or grammar) and
    # samples by the runner's plain program: it may run several decode steps per round.
    multi_step_ok: bool = False
    # The LoRA adapter the request runs with (None: the base model alone).
    lora_request: LoRARequest | None = None
    # The prompt's images (``jaxrunner.multimodal``), in prompt order.
    mm_features: list[MultiModalFeatureSpec] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        # Prompt then outputs, kept as one list: the block hashes read it every step.
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        # What the prefix cache hashes: the tokens, each image's first placeholder standing for the image
        # (its hash); None for a request without images, which hashes its token list itself.
        self._block_hash_ids: list[int | str] | None = None
        if self.mm_features:
            self._block_hash_ids = list(self._all_token_ids)
            for feature in self.mm_features:
                self._block_hash_ids[feature.mm_position.offset] = feature.identifier

    def append_output_token_ids(self, token_id: int) -> None:
        """Add one sampled token to the outputs (and to ``all_token_ids``)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self._block_hash_ids is not None:
            self._block_hash_ids.append(token_id)

    def finish(self, status: RequestStatus) -> None:
        """End the request with ``status`` (a finished one), now."""
        self.status = status
        self.finished_time = time.monotonic()

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def lora_name(self) -> str | None:
        """The adapter's name, None for the base model: what its KV blocks' hashes add to the tokens."""
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens known on the host."""
        return len(self._all_token_ids)

    @property
    def block_hash_ids(self) -> Sequence[int | str]:
        """``all_token_ids`` as the prefix cache hashes them: an image's first placeholder is its hash, so
        prompts with different images never share a block and prompts with the same image do."""
        return self._all_token_ids if self._block_hash_ids is None else self._block_hash_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output token ids; the engine's own list: do not modify it."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        """Whether the request has ended."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish reason ("stop", "length", "abort"), or None while running."""
        return self.status.value if self.is_finished else None
