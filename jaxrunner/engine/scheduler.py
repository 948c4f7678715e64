"""Continuous batching: which requests run each step, and how many tokens each.

vLLM V1's policy: running requests first (decodes, then the next chunk of
unfinished prefills) in arrival order, then waiting requests, all under the
``max_num_seqs`` and ``max_num_batched_tokens`` limits. Long prompts are split
across steps (chunked prefill). When KV blocks run out, the most recently
admitted running request is preempted by recompute: its blocks are freed and
it waits at the front of the queue, to come back later as a new request with
all its tokens. No request is ever dropped.

With LoRA, as vLLM's: the running requests use at most ``max_loras`` distinct
adapters (the base model not counted), the device's adapter slots; a waiting
request whose adapter has no slot is skipped, keeping its place in the queue,
and later requests may start past it. So that it is never starved, the adapter
that has held its slot longest then takes no new request until its running
requests end and the slot frees (``_lora_to_free``): the skipped request, first
in the queue among those waiting for a slot, takes it.

With images, as vLLM's: an image is encoded in the step that first schedules one
of its placeholder tokens, unless the encoder cache holds it already; a step
encodes at most the encoder budget's embeddings, and the cache holds at most its
size (``EncoderCacheManager``). A request whose next image does not fit is
scheduled up to the token before it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterable

from jaxrunner.config import SchedulerConfig
from jaxrunner.engine.encoder_cache_manager import EncoderCacheManager
from jaxrunner.engine.kv_cache_manager import KVCacheManager
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.interfaces import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from jaxrunner.runner.kv_connector.base import KVConnectorBase


@dataclasses.dataclass
class SpecDecodingStats:
    """Draft acceptance: per verification step and per draft position."""

    num_steps: int = 0  # request-steps that verified drafts
    num_drafts: int = 0
    num_accepted: int = 0
    drafted_at: list[int] = dataclasses.field(default_factory=list)
    accepted_at: list[int] = dataclasses.field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Count one request-step that verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.num_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        for counts, n in ((self.drafted_at, num_drafts), (self.accepted_at, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Both replicas' counts together."""
        add_lists = lambda a, b: [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]
        return SpecDecodingStats(
            self.num_steps + other.num_steps,
            self.num_drafts + other.num_drafts,
            self.num_accepted + other.num_accepted,
            add_lists(self.drafted_at, other.drafted_at),
            add_lists(self.accepted_at, other.accepted_at),
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + 1 (vLLM's mean acceptance length)."""
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Per draft position: accepted over drafted."""
        return [a / d for a, d in zip(self.accepted_at + [0] * len(self.drafted_at), self.drafted_at)]


class Scheduler:
    """Produces a ``SchedulerOutput`` per step and consumes the runner's ``ModelRunnerOutput``."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        max_loras: int | None = None,
        encoder_cache_manager: EncoderCacheManager | None = None,
        encoder_compute_budget: int = 0,
        kv_connector: KVConnectorBase | None = None,
    ):
        self.config = config
        # Vision-language models: the encoder cache's bookkeeping and the embeddings a step may encode.
        self.encoder_cache_manager = encoder_cache_manager
        self.encoder_compute_budget = encoder_compute_budget
        # The KV connector's scheduler side (None: none): prompt tokens it loads, blocks it saves.
        self.kv_connector = kv_connector
        # Distinct adapters the running requests may use (None: LoRA off).
        self.max_loras = max_loras
        # An adapter that takes no new request until its slot frees, for a request waiting for one.
        self._lora_to_free: int | None = None
        # Slots past the scheduled tokens that a device-side drafter writes into.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Finished since the last step: the runner frees their state next step.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_scheduled_tokens_total = 0
        self.max_num_scheduled_reqs = 0  # the largest batch of one step, to show what concurrency ran
        self.spec_stats = SpecDecodingStats()

    # ------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (a stop string, an abort); frees their blocks."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.finish(status)
        self.kv_cache_manager.free(request.request_id)
        self._free_encoder_cache(request)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def reset(self) -> None:
        """Forget every request and what the runner was still to be told, after a step that was cut
        short: the engine aborted the requests and drops them from the runner itself."""
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self._finished_req_ids.clear()
        self._lora_to_free = None
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.reset()

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.num_unfinished > 0

    # ------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and their token counts, allocate their KV blocks, and say
        what the runner must add, update and free."""
        budget = self.config.max_num_batched_tokens
        encoder_budget = self.encoder_compute_budget
        encoder_inputs_by_req: dict[str, list[int]] = {}
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        steps = self._decode_steps()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._sampling_last_token(request):
                index += 1
                continue
            remaining = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            num_new = min(remaining + len(request.spec_token_ids), budget)
            if not self.config.enable_chunked_prefill and num_new < remaining:
                break
            encoder_inputs, num_new, encoder_budget = self._try_schedule_encoder_inputs(
                request, request.num_computed_tokens, num_new, encoder_budget
            )
            if num_new == 0:  # its next image does not fit this step's encoder budget or the cache
                index += 1
                continue
            drafts = request.spec_token_ids[: max(num_new - remaining, 0)]
            lookahead = self._lookahead(request, num_new)
            budget -= num_new  # per step: a round of several steps schedules one token a step
            num_new *= steps
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request.request_id, request.block_hash_ids, num_new + lookahead, request.num_computed_tokens
                )
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            self._allocate_encoder_inputs(request, encoder_inputs, encoder_inputs_by_req)
            cached.req_ids.append(request.request_id)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            cached.new_block_ids.append(new_blocks if any(new_blocks) else None)
            num_scheduled[request.request_id] = num_new
            if drafts:
                spec_tokens[request.request_id] = drafts
            self._advance_computed(request, num_new, steps, len(drafts))
            index += 1

        # Waiting requests only when nothing was preempted this step (as vLLM), and never into a round;
        # in order, past those waiting for an adapter slot.
        loras = self._running_loras()
        waiting_index = 0
        while (
            steps == 1
            and not preempted
            and waiting_index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[waiting_index]
            if self._waits_for_lora_slot(request, loras):
                waiting_index += 1
                continue
            tokens = request.all_token_ids
            if request.sampling_params.prompt_logprobs is None:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(
                    request.request_id, request.block_hash_ids, request.lora_name
                )
            else:  # every prompt token must be computed to score it
                computed_blocks, num_computed = (), 0
            num_external = 0
            if self.kv_connector is not None and request.sampling_params.prompt_logprobs is None:
                num_external, _ = self.kv_connector.get_num_new_matched_tokens(request, num_computed)
            remaining = len(tokens) - num_computed - num_external
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            encoder_inputs, num_new, new_encoder_budget = self._try_schedule_encoder_inputs(
                request, num_computed, num_new, encoder_budget
            )
            if num_new == 0:
                break
            new_blocks = self.kv_cache_manager.allocate_slots(
                request.request_id,
                request.block_hash_ids,
                num_external + num_new + self._lookahead(request, num_new, num_computed + num_external),
                num_computed,
                computed_blocks,
                request.lora_name,
            )
            if new_blocks is None:
                break
            encoder_budget = new_encoder_budget
            if self.kv_connector is not None:
                (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)  # connectors: one group
                self.kv_connector.update_state_after_alloc(request, block_ids, num_external)
            num_computed += num_external
            del self.waiting[waiting_index]
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            self.running.append(request)
            if request.lora_int_id:
                loras.setdefault(request.lora_int_id, None)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    prefill_token_ids=list(tokens),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_computed,
                    lora_request=request.lora_request,
                    mm_features=request.mm_features,
                )
            )
            self._allocate_encoder_inputs(request, encoder_inputs, encoder_inputs_by_req)
            num_scheduled[request.request_id] = num_new
            self._advance_computed(request, num_new, steps)
            budget -= num_new

        total_num_scheduled = sum(num_scheduled.values())
        self.num_scheduled_tokens_total += total_num_scheduled
        self.max_num_scheduled_reqs = max(self.max_num_scheduled_reqs, len(num_scheduled))
        finished, self._finished_req_ids = self._finished_req_ids, set()
        connector_metadata = None
        if self.kv_connector is not None:
            scheduled = [self.requests[r] for r in num_scheduled]
            blocks = {r.request_id: self.kv_cache_manager.get_block_ids(r.request_id)[0] for r in scheduled}
            connector_metadata = self.kv_connector.build_connector_meta(scheduled, blocks)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total_num_scheduled,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            free_encoder_mm_hashes=(
                [] if self.encoder_cache_manager is None else self.encoder_cache_manager.get_freed_mm_hashes()
            ),
            scheduled_encoder_inputs=encoder_inputs_by_req,
            kv_connector_metadata=connector_metadata,
            num_decode_steps=steps,
        )

    def _try_schedule_encoder_inputs(
        self, request: Request, num_computed: int, num_new: int, encoder_budget: int
    ) -> tuple[list[int], int, int]:
        """The request's images to encode for the tokens ``[num_computed, num_computed + num_new)``, the
        tokens it may take (fewer: up to an image that does not fit the encoder budget or the cache), and
        the budget left, as vLLM's. Images whose tokens are all computed, or cached already, need nothing."""
        manager = self.encoder_cache_manager
        if manager is None or not request.mm_features or num_new == 0:
            return [], num_new, encoder_budget
        to_encode: list[int] = []
        hashes: set[str] = set()
        num_embeds = 0
        for input_id, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset >= num_computed + num_new:
                break
            if position.end <= num_computed or feature.identifier in hashes:
                continue
            if manager.check_and_update_cache(request, input_id):
                continue
            if not manager.can_allocate(request, input_id, encoder_budget, num_embeds):
                num_new = max(position.offset - num_computed, 0)
                break
            to_encode.append(input_id)
            hashes.add(feature.identifier)
            num_embeds += feature.num_embeds
            encoder_budget -= feature.num_embeds
        return to_encode, num_new, encoder_budget

    def _allocate_encoder_inputs(self, request: Request, input_ids: list[int], scheduled: dict[str, list[int]]) -> None:
        """Room in the encoder cache for the images a scheduled request encodes this step."""
        if not input_ids:
            return
        assert self.encoder_cache_manager is not None
        for input_id in input_ids:
            self.encoder_cache_manager.allocate(request, input_id)
        scheduled[request.request_id] = input_ids

    def _free_encoder_cache(self, request: Request, only_computed: bool = False) -> None:
        """Drop the request's references to its images (``only_computed``: to those whose tokens are all computed)."""
        if self.encoder_cache_manager is None or not request.mm_features:
            return
        for input_id, feature in enumerate(request.mm_features):
            if not only_computed or feature.mm_position.end <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, input_id)

    def _running_loras(self) -> dict[int, None]:
        """The adapters of the running requests (ids, base model left out), in the order they started
        (none with LoRA off); forgets ``_lora_to_free`` once its slot is free."""
        if self.max_loras is None:
            return {}
        loras = dict.fromkeys(r.lora_int_id for r in self.running if r.lora_int_id)
        if self._lora_to_free not in loras:
            self._lora_to_free = None
        return loras

    def _waits_for_lora_slot(self, request: Request, loras: dict[int, None]) -> bool:
        """Whether the waiting request must wait for an adapter slot: its adapter is not running and
        ``max_loras`` others are, or its adapter is the one being freed. The first such request picks
        the adapter to free: the one whose requests started first."""
        lora = request.lora_int_id
        if not lora or self.max_loras is None:
            return False
        if lora == self._lora_to_free:
            return True
        if lora in loras or len(loras) < self.max_loras:
            return False
        if self._lora_to_free is None:
            self._lora_to_free = next(iter(loras))
        return True

    @staticmethod
    def _advance_computed(request: Request, num_new: int, steps: int, num_drafts: int = 0) -> None:
        """Count a scheduled request's new tokens as computed, as soon as it is scheduled; a step
        that samples holds placeholders for the most tokens it can emit (its drafts + 1, as vLLM)."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += steps + num_drafts  # the round samples its next token(s)

    def _decode_steps(self) -> int:
        """Decode steps this round may run back to back (multi-step scheduling); 1 for a single step.

        Several only when every running request is a decode that can end only at its
        length limit, no request waits while a seat is free, and the free blocks hold
        every request's next tokens; then the largest allowed count that takes no
        request past its length limit, so none finishes before the round's last step.
        Requests whose last token is already being sampled are left out: they are not
        scheduled again.
        """
        if self.config.num_scheduler_steps == 1 or not self.running:
            return 1
        counts = self.config.decode_step_counts
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return 1
        most = counts[-1]
        decoding = [r for r in self.running if not self._sampling_last_token(r)]
        if not decoding:
            return 1
        for request in decoding:
            pending = request.num_output_placeholders
            if not request.multi_step_ok or request.num_tokens + pending - request.num_computed_tokens != 1:
                return 1
            most = min(most, self._tokens_left(request))
        steps = max(c for c in counts if c <= max(most, 1))
        manager = self.kv_cache_manager
        needed = sum(manager.num_blocks_to_grow(r.request_id, r.num_computed_tokens + steps) for r in decoding)
        return steps if manager.can_fit(needed) else 1

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Lookahead slots only once the prefill completes, so no partial block is hashed early; none
        past max_model_len (as vLLM), where the request ends: no draft there is ever verified."""
        computed = request.num_computed_tokens if num_computed is None else num_computed
        end = request.num_tokens + request.num_output_placeholders
        room = max(self.max_model_len - computed - num_new, 0)
        return min(self.num_lookahead_tokens, room) if computed + num_new >= end else 0

    def _sampling_last_token(self, request: Request) -> bool:
        """Whether a step in flight samples the request's last token: it is not scheduled again."""
        return request.num_output_placeholders > 0 and self._at_length_limit(request)

    def _at_length_limit(self, request: Request) -> bool:
        """Whether the tokens being sampled already take the request to max_tokens or max_model_len."""
        return self._tokens_left(request) <= 0

    def _tokens_left(self, request: Request) -> int:
        """Tokens the request may still sample beyond those being sampled, by max_tokens and max_model_len."""
        pending = request.num_output_placeholders
        left = self.max_model_len - request.num_tokens - pending
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - len(request.output_token_ids) - pending)
        return left

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it first; a token it is still sampling is kept
        when it arrives (``update_from_output``), before the request can be resumed."""
        self.kv_cache_manager.free(request.request_id)
        self._free_encoder_cache(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # --------------------------------------------------------------- update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, apply the stop conditions; returns (request, new tokens) pairs.

        Under async scheduling the output may come after the request was scheduled
        again (its next step reads the token on the device) or preempted; a request
        that finished meanwhile is gone from ``requests`` and its token is dropped.
        """
        updates = []
        now = time.monotonic()
        if self.encoder_cache_manager is not None:
            for req_id in scheduler_output.num_scheduled_tokens:
                request = self.requests.get(req_id)
                if request is not None:
                    self._free_encoder_cache(request, only_computed=True)
        steps, spec = scheduler_output.num_decode_steps, scheduler_output.scheduled_spec_decode_tokens
        for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or not sampled:
                continue
            drafts = spec.get(req_id) if spec else None
            request.num_output_placeholders -= steps + (len(drafts) if drafts else 0)
            request.spec_token_ids = []
            if drafts:
                # Rejected drafts' KV positions are recomputed: they were never computed. A request
                # preempted meanwhile (async scheduling) computes everything again anyway.
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= len(drafts) - (len(sampled) - 1)
                self.spec_stats.record(len(drafts), len(sampled) - 1)
            new_tokens = []
            for token in sampled:
                request.append_output_token_ids(token)
                new_tokens.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self.finish_requests([req_id], status)
                    break
            if request.first_token_time is None:
                request.first_token_time = now
            updates.append((request, new_tokens))
        return updates

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in (params.stop_token_ids or ()):
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
