"""The engine loop: requests in, one scheduler/runner step at a time, outputs out.

A prompt goes through the ``InputProcessor`` (refused there with an error
output of its own if it could never run) into the scheduler; each step then
schedules, dispatches the runner, and hands the sampled tokens to the
scheduler and to the ``OutputProcessor``, which turns them into
``RequestOutput``s.

Whatever cuts a step short (an exception, KeyboardInterrupt included, raised
anywhere inside it) leaves the engine consistent: it aborts every prompt,
drops the step in flight, frees every block and slot and re-creates the
device buffers the runner lost (``_recover``), so the next call runs as on a
fresh engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator

from jaxrunner.engine.input_processor import InputProcessor, PreparedPrompt
from jaxrunner.engine.ngram_proposer import NgramProposer
from jaxrunner.engine.output_processor import OutputProcessor, refused_output
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.engine.prompts import ParsedPrompt, PromptType, parse_prompt
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.engine.structured_outputs import StructuredOutputManager
from jaxrunner.interfaces import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    RequestOutputKind,
    SamplingParams,
    SchedulerOutput,
)
from jaxrunner.lora.request import LoRARequest
from jaxrunner.multimodal.processing import MultiModalProcessor
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.runner.step_recovery import reset_runner


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one engine step's forward passes did (a round of decode steps counting each pass)."""

    forward_passes: int
    """Each reads every weight."""
    tokens: int
    """Rows multiplied by the weight matrices, over all passes."""
    kv_tokens_read: int
    """KV cache tokens read, over all passes."""
    attention_pairs: int
    """(query token, key token) pairs the attention scored, over all passes."""


@dataclasses.dataclass
class StepTimes:
    """Where the engine's steps spent their wall time (its own host work, the program calls, or waiting),
    and what their forward passes read."""

    num_steps: int = 0
    host_s: float = 0.0
    """The engine's Python in ``step()``: scheduling, input packing, output handling."""
    call_s: float = 0.0
    """Inside calls of the compiled programs, which return once XLA has launched their kernels."""
    wait_s: float = 0.0
    """Blocked until a step's sampled tokens reached the host."""
    decode_steps: int = 0
    """Decode steps dispatched by steps that dispatched decodes only (one token per request and
    decode step, no new request), as did the step before them: under async scheduling a step
    waits for the one it follows. A round of several decode steps counts as that many."""
    decode_host_s: float = 0.0
    """``host_s`` of those steps."""
    decode_wall_s: float = 0.0
    """Wall time of those steps: in steady state, the device's step time."""
    forward_passes: int = 0
    """Forward passes the steps dispatched, a round of several decode steps counting as that many:
    each reads every weight."""
    kv_tokens_read: int = 0
    """KV cache tokens those passes read (``_step_work``): what bounds a decode step with the weights."""
    work: list[StepWork] | None = None
    """Each step's ``StepWork``, kept where a benchmark asks for it (sets a list): ``jaxrunner bench`` bounds
    its run step by step (``roofline.step_floor_s``)."""


def _decodes_only(scheduler_output: SchedulerOutput) -> bool:
    """Whether a step schedules one token for each of its requests and decode steps, and no new request."""
    num_reqs = len(scheduler_output.num_scheduled_tokens)
    return (
        num_reqs > 0
        and not scheduler_output.scheduled_new_reqs
        and scheduler_output.total_num_scheduled_tokens == num_reqs * scheduler_output.num_decode_steps
    )


def _step_work(scheduler_output: SchedulerOutput) -> StepWork:
    """What a step's forward passes do: each request's new tokens read its computed tokens' KV and their own.

    A request of ``c`` computed tokens and ``n`` new ones (a prefill chunk, a token and its
    drafts, or a round of ``n`` decode steps of one token each) reads ``c + n`` KV tokens,
    ``n`` times over a round, and scores ``n c + n (n + 1) / 2`` (query, key) pairs.
    """
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    steps = scheduler_output.num_decode_steps
    kv_tokens = pairs = 0
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        c = computed[req_id]
        kv_tokens += steps * c + n * (steps + 1) // 2
        pairs += n * c + n * (n + 1) // 2
    return StepWork(steps, scheduler_output.total_num_scheduled_tokens, kv_tokens, pairs)


class LLMEngine:
    """Runs requests to completion over a ``Scheduler`` and a ``ModelRunner``."""

    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, tokenizer=None, mm_processor: MultiModalProcessor | None = None
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.spans = runner.spans
        self.max_model_len = runner.max_model_len
        self.structured_outputs = (
            StructuredOutputManager(tokenizer, runner.vocab_size) if tokenizer is not None else None
        )
        self.input_processor = InputProcessor(runner, scheduler, tokenizer, self.structured_outputs, mm_processor)
        self.output_processor = OutputProcessor(scheduler, tokenizer, self.structured_outputs)
        spec = runner.config.speculative_config
        self.num_spec = runner.config.num_speculative_tokens
        self.proposer = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, runner.max_model_len
            )
        # A dispatched step whose tokens are not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        self._last_dispatch_decodes_only = False
        self.step_times = StepTimes()
        # Final outputs of prompts aborted by abort_request, for the next step() to return.
        self._aborted_outputs: list[RequestOutput] = []
        # Inside a change of state (_changing_state); a change cut short where no handler ran leaves
        # _needs_recovery set, and the next change recovers first.
        self._busy = False
        self._needs_recovery = False
        # Aborts asked for while a change ran (a stream's finalizer run by the garbage collector).
        self._deferred_aborts: list[tuple[list[str], bool]] = []

    # ------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput | None:
        """Queue a prompt (text, token ids, a TextPrompt or TokensPrompt dict); returns a finished error
        output instead if the request is invalid. ``output_kind`` (vLLM's ``SamplingParams.output_kind``)
        says which of its outputs ``step`` returns: CUMULATIVE the whole text so far, DELTA only what is
        new since the last one (streaming), FINAL_ONLY only the finished prompt's. ``lora_request``
        names the LoRA adapter it runs with (None: the base model)."""
        prepared = self.prepare_request(request_id, parse_prompt(prompt), params, lora_request)
        if isinstance(prepared, RequestOutput):
            return prepared
        self.add_prepared(prepared, output_kind)
        return None

    def prepare_request(
        self, request_id: str, prompt: ParsedPrompt, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> PreparedPrompt | RequestOutput:
        """A prompt checked and made into its requests without queueing it, or the finished error output
        of a refused one. Its grammars are registered already: ``add_prepared`` or ``discard`` it."""
        token_ids: list[int] = []
        try:
            token_ids = self.input_processor.tokenize(prompt)
            token_ids, mm_features = self.input_processor.process_multimodal(prompt, token_ids)
            requests = self.input_processor.make_requests(request_id, token_ids, params, lora_request, mm_features)
        except ValueError as error:
            return refused_output(request_id, prompt.text, token_ids, str(error), lora_request)
        return PreparedPrompt(request_id, prompt.text, token_ids, requests)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check a LoRA adapter now (vLLM's name), so that no request naming it is refused for
        it later; ``ValueError`` naming the adapter and what is wrong otherwise."""
        self.input_processor.lora_requests.check(lora_request)
        return True

    def discard(self, prepared: PreparedPrompt) -> None:
        """Forget a prepared prompt that will not be added."""
        self.input_processor.discard(prepared.requests)

    def add_prepared(self, prepared: PreparedPrompt, output_kind: RequestOutputKind) -> None:
        """Queue a prepared prompt; an add cut short is undone."""
        self._recover_if_needed()
        try:
            self.output_processor.add_prompt(
                prepared.request_id, prepared.prompt, prepared.token_ids, prepared.requests, output_kind
            )
            for request in prepared.requests:
                self.scheduler.add_request(request)
        except BaseException:
            self.abort_request([prepared.request_id], internal=True)
            raise

    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Finish prompts now, status aborted, freeing their blocks; unknown or finished ids are ignored.

        As vLLM's: the next ``step()`` returns each aborted prompt's final output, finish
        reason "abort" on its unfinished sequences, so that whoever streams it sees it
        end; ``internal`` leaves that out (no one listens: a stream closed, a call that
        failed). An engine left with no request frees the runner's slots at once. Asked
        while a step runs (by a finalizer), the abort waits for the step's end.
        """
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self._busy:
            self._deferred_aborts.append((request_ids, internal))
            return
        with self._changing_state():
            self._abort(request_ids, internal)

    def _abort(self, request_ids: list[str], internal: bool) -> None:
        for request_id in request_ids:
            output = self.output_processor.abort(request_id, final_output=not internal)
            if output is not None:
                self._aborted_outputs.append(output)
        if internal:
            dropped = set(request_ids)
            self._aborted_outputs = [o for o in self._aborted_outputs if o.request_id not in dropped]
        if not self.scheduler.has_unfinished_requests():
            self._settle()

    def _settle(self) -> None:
        """With no request left: drop the step in flight (its tokens are all of finished requests) and
        free the runner's slots of the finished ones now, by a step that schedules nothing."""
        self._in_flight = None
        self.runner.execute_model(self.scheduler.schedule())

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running, or an aborted prompt's final output is still
        to be returned by ``step()``."""
        return self.scheduler.has_unfinished_requests() or bool(self._aborted_outputs)

    @property
    def num_unfinished_prompts(self) -> int:
        """Prompts added and not finished yet (the load data parallelism balances)."""
        return self.output_processor.num_prompts

    @property
    def unfinished_prompt_ids(self) -> list[str]:
        """The request ids of the prompts added and not finished yet."""
        return self.output_processor.prompt_ids

    # ------------------------------------------------------- consistency

    @contextlib.contextmanager
    def _changing_state(self) -> Iterator[None]:
        """A change of the engine's state that must not be left half done. If anything escapes it,
        KeyboardInterrupt included, the engine recovers before it propagates; a change cut short
        where no handler ran (between two bytecodes of this manager) is recovered from by the next.
        Aborts asked for meanwhile are applied at its end."""
        self._recover_if_needed()
        self._needs_recovery = self._busy = True
        try:
            yield
        except BaseException:
            self._recover()
            raise
        finally:
            self._busy = False
        self._needs_recovery = False
        while self._deferred_aborts:
            request_ids, internal = self._deferred_aborts.pop(0)
            self.abort_request(request_ids, internal)

    def _recover_if_needed(self) -> None:
        """Recover from a change cut short where no handler ran (called outside any change)."""
        if self._needs_recovery:
            self._recover()
            self._busy = False

    def _recover(self) -> None:
        """Consistent again after a change was cut short: every prompt aborted (their final outputs
        queued for ``step``), the step in flight dropped, the scheduler, the block pool (prefix cache
        included: that step's blocks may never have been written) and the runner's requests reset,
        and the device buffers the runner lost re-created."""
        self._needs_recovery = True
        self._in_flight = None
        self._deferred_aborts.clear()
        self._aborted_outputs += self.output_processor.abort_all()
        self.scheduler.reset()
        self.scheduler.kv_cache_manager.reset()
        reset_runner(self.runner)
        self._needs_recovery = False

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One scheduler + runner step; outputs of the prompts that advanced or finished, each as its
        output kind asks (``add_request``), after the final outputs of prompts aborted since the last.

        With async scheduling the step schedules and dispatches step k+1, then
        processes step k's tokens while the device runs k+1, so the outputs it
        returns are one step behind the dispatch. It falls back to one step at a
        time while a request needs its last tokens before it can be scheduled
        (a grammar's next bitmask; n-gram drafts proposed on the host never overlap).
        A step cut short by an exception leaves every prompt aborted and the engine
        ready (``_recover``).
        """
        with self._changing_state():
            outputs = self._step()
            aborted, self._aborted_outputs = self._aborted_outputs, []
        return aborted + outputs

    def _step(self) -> list[RequestOutput]:
        start, wait_before, call_before = time.perf_counter(), self.runner.device_wait_s, self.runner.program_call_s
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and not self._can_overlap():
            outputs += self._process(*self._in_flight)
            self._in_flight = None
        with self.spans("schedule"):
            scheduler_output = self.scheduler.schedule()
        runner_output = self._dispatch(scheduler_output)
        if self._in_flight is not None:
            outputs += self._process(*self._in_flight)
            self._in_flight = None
        if isinstance(runner_output, AsyncModelRunnerOutput) and self._can_overlap():
            self._in_flight = (scheduler_output, runner_output)
        else:
            outputs += self._process(scheduler_output, runner_output)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Every request has finished: the step in flight only holds tokens of finished
            # requests. Settle it now, so that nothing of it reaches requests added later.
            outputs += self._process(*self._in_flight)
            self._in_flight = None
        if self.runner.uses_kv_connector and not self.scheduler.has_unfinished_requests():
            # Idle: store the last saves, for another engine to read now.
            self.runner.kv_connector.get_finished(flush=True)
        self._record_times(scheduler_output, start, wait_before, call_before)
        return outputs

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's tokens are known."""
        return self.runner.use_async_scheduling and not self._has_grammars()

    def _has_grammars(self) -> bool:
        """Whether any request is constrained by a grammar (most steps have none: their work is skipped)."""
        return self.structured_outputs is not None and self.structured_outputs.num_requests > 0

    def _dispatch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run the runner's step: execute_model, then sample_tokens when anything was scheduled."""
        runner_output = self.runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens > 0:
            grammar = None
            if self._has_grammars():
                assert self.structured_outputs is not None  # _has_grammars checked it
                grammar = self.structured_outputs.grammar_output(
                    list(scheduler_output.num_scheduled_tokens), scheduler_output.scheduled_spec_decode_tokens
                )
            return self.runner.sample_tokens(grammar)
        return runner_output if runner_output is not None else ModelRunnerOutput.make_empty()

    def _process(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | AsyncModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply one step's tokens: the scheduler's update, then the outputs; then the next drafts."""
        if isinstance(runner_output, AsyncModelRunnerOutput):
            runner_output = runner_output.get_output()
        with self.spans("update_from_output"):
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        with self.spans("process_outputs"):
            outputs = self.output_processor.process(runner_output, updates)
        if self.num_spec:
            with self.spans("propose_drafts"):
                self._propose_drafts()
        return outputs

    def _propose_drafts(self) -> None:
        """Drafts for every decoding request, within its remaining token allowance.

        N-gram drafts are proposed here; a draft model leaves its drafts on the
        device, so the scheduler gets placeholders that only carry their number,
        but for requests under a grammar, which needs the drafts themselves for
        its bitmask and keeps only those it takes. Under async scheduling a step
        may be in flight: its tokens (placeholders) count as known, and the
        drafts are for the step after it.
        """
        grammars = self.structured_outputs if self._has_grammars() else None
        device_drafts = self.runner.take_draft_token_ids() if grammars is not None else {}
        for request in self.scheduler.running:
            pending = request.num_output_placeholders
            if request.num_computed_tokens != request.num_tokens + pending - 1:
                continue  # still prefilling
            params = request.sampling_params
            left = self.max_model_len - request.num_tokens - pending
            if params.max_tokens is not None:
                left = min(left, params.max_tokens - len(request.output_token_ids) - pending)
            # The step emits drafts + 1 tokens: never more than the request may still produce.
            room = max(left - 1, 0)
            if self.proposer is not None:
                drafts = self.proposer.propose(request.all_token_ids)
            else:
                drafts = device_drafts.get(request.request_id, [-1] * self.num_spec)
            if grammars is not None and grammars.has(request.request_id):
                drafts = grammars.validate_drafts(request.request_id, drafts)
            request.spec_token_ids = drafts[:room]

    def _record_times(self, scheduler_output: SchedulerOutput, start: float, wait_before: float, call_before: float):
        """Add this step to ``step_times``: its host work is its wall time less the runner's program calls and waits."""
        waited = self.runner.device_wait_s - wait_before
        called = self.runner.program_call_s - call_before
        wall = time.perf_counter() - start
        host = wall - waited - called
        times = self.step_times
        times.num_steps += 1
        times.wait_s += waited
        times.call_s += called
        times.host_s += host
        if scheduler_output.total_num_scheduled_tokens:
            work = _step_work(scheduler_output)
            times.forward_passes += work.forward_passes
            times.kv_tokens_read += work.kv_tokens_read
            if times.work is not None:
                times.work.append(work)
        decodes_only = _decodes_only(scheduler_output)
        if decodes_only and self._last_dispatch_decodes_only:
            times.decode_steps += scheduler_output.num_decode_steps
            times.decode_host_s += host
            times.decode_wall_s += wall
        self._last_dispatch_decodes_only = decodes_only
