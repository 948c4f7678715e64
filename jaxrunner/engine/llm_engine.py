"""The engine loop: requests in, one scheduler/runner step at a time, outputs out.

It owns the per-request output side that the scheduler does not: turning
tokens into text incrementally, stop strings, ``n > 1`` fan-out, and the
``RequestOutput`` objects. A bad request is refused with an error output of
its own; it never reaches the scheduler or the runner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.interfaces import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    RequestOutputKind,
    SamplingParams,
    SchedulerOutput,
)
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.engine.ngram_proposer import NgramProposer
from jaxrunner.engine.structured_outputs import StructuredOutputManager


@dataclasses.dataclass
class StepTimes:
    """Where the engine's steps spent their wall time: its own host work, the program calls, or waiting."""

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


def _decodes_only(scheduler_output: SchedulerOutput) -> bool:
    """Whether a step schedules one token for each of its requests and decode steps, and no new request."""
    num_reqs = len(scheduler_output.num_scheduled_tokens)
    return (
        num_reqs > 0
        and not scheduler_output.scheduled_new_reqs
        and scheduler_output.total_num_scheduled_tokens == num_reqs * scheduler_output.num_decode_steps
    )


@dataclasses.dataclass
class _Sequence:
    """One generated sequence of a prompt (``n`` of them per prompt)."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_streamed_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0


@dataclasses.dataclass
class _Prompt:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        """Whether every sequence of the prompt has finished."""
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    """Runs requests to completion over a ``Scheduler`` and a ``ModelRunner``."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer=None):
        self.runner = runner
        spec = runner.config.speculative_config
        self.num_spec = runner.config.num_speculative_tokens
        self.proposer = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, runner.max_model_len
            )
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.max_model_len = runner.max_model_len
        self.structured_outputs = (
            StructuredOutputManager(tokenizer, runner.vocab_size) if tokenizer is not None else None
        )
        self._prompts: dict[str, _Prompt] = {}
        # Each running sequence's request id -> its prompt and its sequence.
        self._by_request_id: dict[str, tuple[_Prompt, _Sequence]] = {}
        # A dispatched step whose tokens are not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        self._last_dispatch_decodes_only = False
        self.step_times = StepTimes()
        self.spans = runner.spans

    # ------------------------------------------------------------- requests

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> RequestOutput | None:
        """Queue a prompt; returns a finished error output instead if the request is invalid."""
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids: list[int] = []
        try:
            token_ids = self._tokenize(prompt)
            self._validate(token_ids, params)
            params = self._with_token_lists(params)
            self.runner.check_sampling_params(params)
            sequences = self._sequences(request_id, token_ids, params)
            self._add_grammars(sequences, params)
        except ValueError as error:
            return RequestOutput(
                request_id, prompt_text, token_ids, [CompletionOutput(0, "", [], finish_reason="error")],
                finished=True, error=str(error),
            )
        prompt_logprobs = [None] * len(token_ids) if params.prompt_logprobs is not None else None
        entry = _Prompt(request_id, prompt_text, token_ids, sequences, sequences[0].request.arrival_time,
                        prompt_logprobs)
        self._prompts[request_id] = entry
        for seq in sequences:
            self._by_request_id[seq.request.request_id] = (entry, seq)
            self.scheduler.add_request(seq.request)
        return None

    def _sequences(self, request_id: str, token_ids: list[int], params: SamplingParams) -> list[_Sequence]:
        """The ``n`` sequences of a prompt; with a seed, child i samples with seed + i."""
        arrival = time.monotonic()
        # Children differ only in their seeds, which decide nothing here.
        multi_step_ok = self.scheduler.config.num_scheduler_steps > 1 and self._runs_to_length(params)
        sequences = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = Request(child_id, token_ids, child_params, self.eos_token_id, arrival_time=arrival,
                              multi_step_ok=multi_step_ok)
            logprobs = [] if params.logprobs is not None else None
            sequences.append(_Sequence(request, self._detokenizer(token_ids, child_params), logprobs=logprobs))
        return sequences

    def _runs_to_length(self, params: SamplingParams) -> bool:
        """Whether a request can end only at its length limit and samples plainly: several decode
        steps per round take it. ``params`` carries its stop ids (EOS included unless ignored)."""
        return (
            not params.all_stop_token_ids and not params.stop and params.structured_outputs is None
            and self.runner.samples_plainly(params)
        )

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("This engine has no tokenizer; pass prompts as lists of token ids.")
            return list(self.tokenizer.encode(prompt))
        token_ids = [int(t) for t in prompt]
        vocab = self.runner.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        return token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
        params._validate()  # fields may have been changed after construction
        if not token_ids:
            raise ValueError("The prompt is empty; give at least one token.")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, more than max_model_len ({self.max_model_len})."
            )
        scheduler_config = self.scheduler.config
        if not scheduler_config.enable_chunked_prefill and len(token_ids) > scheduler_config.max_num_batched_tokens:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({scheduler_config.max_num_batched_tokens}) with chunked prefill off: it could never be scheduled."
            )
        manager = self.scheduler.kv_cache_manager
        needed = manager.num_blocks_for(len(token_ids) + 1 + self.scheduler.num_lookahead_tokens, manager.block_size)
        if needed > manager.num_usable_blocks:
            raise ValueError(
                f"The prompt needs {needed} KV cache blocks, more than the whole cache holds "
                f"({manager.num_usable_blocks}); shorten it or give the cache more memory."
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to detect stop strings.")
        if self.num_spec and (params.logprobs is not None or params.structured_outputs is not None):
            raise ValueError(
                "SamplingParams.logprobs and structured_outputs are not supported with speculative decoding yet; "
                "turn speculative decoding off for these requests' engine."
            )

    def _add_grammars(self, sequences: list[_Sequence], params: SamplingParams) -> None:
        """One grammar matcher per sequence; none is left behind if one fails."""
        if params.structured_outputs is None:
            return
        if self.structured_outputs is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer.")
        added = []
        try:
            for seq in sequences:
                self.structured_outputs.add_request(seq.request.request_id, params.structured_outputs)
                added.append(seq.request.request_id)
        except ValueError:
            for req_id in added:
                self.structured_outputs.remove_request(req_id)
            raise

    def _with_token_lists(self, params: SamplingParams) -> SamplingParams:
        """Add what the runner needs as token ids: min_tokens' stop ids and the bad words."""
        stop_ids = list(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(self.eos_token_id)
        bad_words = []
        for word in params.bad_words or []:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.bad_words needs a tokenizer.")
            # As vLLM: the word as it is and after a space, without special tokens.
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in bad_words:
                    bad_words.append(ids)
        return dataclasses.replace(params, all_stop_token_ids=stop_ids, bad_words_token_ids=bad_words)

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, stop=list(params.stop))

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """Finish the prompts ``request_ids`` now (status aborted); unknown ids are ignored."""
        for request_id in request_ids:
            entry = self._prompts.get(request_id)
            if entry is not None:
                self.scheduler.finish_requests(
                    [s.request.request_id for s in entry.sequences], RequestStatus.FINISHED_ABORTED
                )
                self._release(entry)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_prompts(self) -> int:
        """Prompts added and not finished yet (the load data parallelism balances)."""
        return len(self._prompts)

    # ----------------------------------------------------------------- step

    def step(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> list[RequestOutput]:
        """One scheduler + runner step; outputs of the prompts that advanced or finished.

        ``output_kind`` DELTA gives each output only the text and tokens new since
        the last one (streaming), FINAL_ONLY only finished prompts' outputs (no
        text is built for the others), CUMULATIVE the whole text so far.

        With async scheduling the step schedules and dispatches step k+1, then
        processes step k's tokens while the device runs k+1, so the outputs it
        returns are one step behind the dispatch. It falls back to one step at a
        time while a request needs its last tokens before it can be scheduled
        (speculative drafts, a grammar's next bitmask).
        """
        start, wait_before, call_before = time.perf_counter(), self.runner.device_wait_s, self.runner.program_call_s
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and not self._can_overlap():
            outputs += self._process(*self._in_flight, output_kind)
            self._in_flight = None
        with self.spans("schedule"):
            scheduler_output = self.scheduler.schedule()
        runner_output = self._dispatch(scheduler_output)
        if self._in_flight is not None:
            outputs += self._process(*self._in_flight, output_kind)
            self._in_flight = None
        if isinstance(runner_output, AsyncModelRunnerOutput) and self._can_overlap():
            self._in_flight = (scheduler_output, runner_output)
        else:
            outputs += self._process(scheduler_output, runner_output, output_kind)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Every request has finished: the step in flight only holds tokens of finished
            # requests. Settle it now, so that nothing of it reaches requests added later.
            outputs += self._process(*self._in_flight, output_kind)
            self._in_flight = None
        waited = self.runner.device_wait_s - wait_before
        called = self.runner.program_call_s - call_before
        wall = time.perf_counter() - start
        host = wall - waited - called
        times = self.step_times
        times.num_steps += 1
        times.wait_s += waited
        times.call_s += called
        times.host_s += host
        decodes_only = _decodes_only(scheduler_output)
        if decodes_only and self._last_dispatch_decodes_only:
            times.decode_steps += scheduler_output.num_decode_steps
            times.decode_host_s += host
            times.decode_wall_s += wall
        self._last_dispatch_decodes_only = decodes_only
        return outputs

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's tokens are known."""
        return self.runner.use_async_scheduling and not self._has_grammars()

    def _has_grammars(self) -> bool:
        """Whether any request is constrained by a grammar (most steps have none: their work is skipped)."""
        return self.structured_outputs is not None and self.structured_outputs.num_requests > 0

    def _dispatch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run the runner's step: execute_model, then sample_tokens when anything was scheduled."""
        with self.spans("execute_model"):
            runner_output = self.runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens > 0:
            grammar = None
            if self._has_grammars():
                grammar = self.structured_outputs.grammar_output(list(scheduler_output.num_scheduled_tokens))
            with self.spans("sample_tokens"):
                return self.runner.sample_tokens(grammar)
        return runner_output if runner_output is not None else ModelRunnerOutput.make_empty()

    def _process(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput | AsyncModelRunnerOutput,
        output_kind: RequestOutputKind,
    ) -> list[RequestOutput]:
        """Apply one step's tokens: scheduler update, logprobs, grammars, text and stop strings."""
        with self.spans("process_outputs"):
            return self._process_outputs(scheduler_output, runner_output, output_kind)

    def _process_outputs(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput | AsyncModelRunnerOutput,
        output_kind: RequestOutputKind,
    ) -> list[RequestOutput]:
        if isinstance(runner_output, AsyncModelRunnerOutput):
            runner_output = runner_output.get_output()
        touched: dict[str, _Prompt] = {}
        ending: set[str] = set()  # prompts with a sequence that finished in this update
        self._record_prompt_logprobs(runner_output)
        logprob_rows = self._logprob_rows(runner_output)
        has_grammars = self._has_grammars()
        for request, new_tokens in self.scheduler.update_from_output(scheduler_output, runner_output):
            entry, seq = self._by_request_id[request.request_id]
            if seq.logprobs is not None:
                self._record_logprobs(seq, runner_output, logprob_rows[request.request_id][: len(new_tokens)])
            grammar_done = has_grammars and self._advance_grammar(request, new_tokens)
            finished = request.is_finished
            if seq.detokenizer is not None:
                # A stop token id (or EOS) ends the text without its own text, as in vLLM.
                by_token = finished and request.status is RequestStatus.FINISHED_STOPPED and not grammar_done
                stop_str = seq.detokenizer.update(new_tokens, finished=finished, stop_terminated=by_token)
                if stop_str is not None:
                    self._stop_on_string(request, stop_str)
                    finished = request.is_finished
            touched[entry.request_id] = entry
            if finished:
                ending.add(entry.request_id)
        if self.num_spec:
            self._propose_drafts()
        outputs = []
        final_only, delta = output_kind == RequestOutputKind.FINAL_ONLY, output_kind == RequestOutputKind.DELTA
        for entry in touched.values():
            finished = entry.request_id in ending and entry.finished
            if finished or not final_only:
                outputs.append(self._make_output(entry, delta))
            if finished:
                self._release(entry)
        return outputs

    def _propose_drafts(self) -> None:
        """Drafts for every decoding request, within its remaining token allowance.

        N-gram drafts are proposed here; a draft model leaves its drafts on the
        device, so the scheduler gets placeholders that only carry their number.
        """
        for request in self.scheduler.running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling
            params = request.sampling_params
            left = self.max_model_len - request.num_tokens
            if params.max_tokens is not None:
                left = min(left, params.max_tokens - len(request.output_token_ids))
            # The step emits drafts + 1 tokens: never more than the request may still produce.
            room = max(left - 1, 0)
            if self.proposer is None:
                request.spec_token_ids = [-1] * min(self.num_spec, room)
            else:
                request.spec_token_ids = self.proposer.propose(request.all_token_ids)[:room]

    @staticmethod
    def _logprob_rows(runner_output: ModelRunnerOutput) -> dict[str, range]:
        if runner_output.logprobs is None:
            return {}
        cu = runner_output.logprobs.cu_num_generated_tokens
        return {req_id: range(cu[i], cu[i + 1]) for i, req_id in enumerate(runner_output.req_ids)}

    def _logprob_dict(self, ids, logprobs, chosen_rank: int, count: int) -> dict[int, Logprob]:
        """The chosen token (column 0) and the top ``count``, with ranks and text."""
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        out = {int(ids[0]): Logprob(float(logprobs[0]), int(chosen_rank), decode(int(ids[0])))}
        for rank, (token, value) in enumerate(zip(ids[1 : count + 1], logprobs[1 : count + 1]), start=1):
            out.setdefault(int(token), Logprob(float(value), rank, decode(int(token))))
        return out

    def _record_logprobs(self, seq: _Sequence, runner_output: ModelRunnerOutput, rows: range) -> None:
        lists = runner_output.logprobs
        count = seq.request.sampling_params.logprobs
        for row in rows:
            entry = self._logprob_dict(
                lists.logprob_token_ids[row], lists.logprobs[row], lists.sampled_token_ranks[row], count
            )
            seq.logprobs.append(entry)
            seq.cumulative_logprob += float(lists.logprobs[row][0])

    def _record_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        for req_id, (first, lists) in runner_output.prompt_logprobs_dict.items():
            entry, _ = self._by_request_id.get(req_id, (None, None))
            if entry is None or entry.prompt_logprobs is None or entry.sequences[0].request.request_id != req_id:
                continue
            count = entry.sequences[0].request.sampling_params.prompt_logprobs
            for i in range(len(lists.logprobs)):
                entry.prompt_logprobs[first + i] = self._logprob_dict(
                    lists.logprob_token_ids[i], lists.logprobs[i], lists.sampled_token_ranks[i], count
                )

    def _advance_grammar(self, request: Request, new_tokens: list[int]) -> bool:
        """Feed sampled tokens to the matcher; True if that finished the request.

        A complete grammar allows only EOS next, which ignore_eos or min_tokens
        may forbid, so completion itself ends the request.
        """
        manager = self.structured_outputs
        if manager is None or not manager.has(request.request_id) or request.is_finished:
            return False
        if not manager.accept_tokens(request.request_id, new_tokens):
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            return True
        if manager.is_terminated(request.request_id):
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def _stop_on_string(self, request: Request, stop_str: str) -> None:
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        request.stop_reason = stop_str

    def _release(self, entry: _Prompt) -> None:
        del self._prompts[entry.request_id]
        for seq in entry.sequences:
            del self._by_request_id[seq.request.request_id]
            if self.structured_outputs is not None:
                self.structured_outputs.remove_request(seq.request.request_id)

    def _make_output(self, entry: _Prompt, delta: bool) -> RequestOutput:
        completions = []
        for index, seq in enumerate(entry.sequences):
            request = seq.request
            token_ids = request.output_token_ids[seq.num_streamed_tokens if delta else 0 :]
            if delta:
                seq.num_streamed_tokens = len(request.output_token_ids)
            if seq.detokenizer is None:
                text = ""
            elif delta:
                text = seq.detokenizer.get_next_output_text(request.is_finished, delta=True)
            else:
                text = seq.detokenizer.output_text
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=self._streamed(seq.logprobs, len(token_ids)) if delta else seq.logprobs,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        first = [s.request.first_token_time for s in entry.sequences if s.request.first_token_time]
        done = [s.request.finished_time for s in entry.sequences if s.request.finished_time]
        metrics = RequestMetrics(
            arrival_time=entry.arrival_time,
            first_token_time=min(first) if first else None,
            finished_time=max(done) if entry.finished and done else None,
            num_generated_tokens=max(len(s.request.output_token_ids) for s in entry.sequences),
        )
        return RequestOutput(
            entry.request_id, entry.prompt, entry.prompt_token_ids, completions, entry.finished, metrics,
            prompt_logprobs=entry.prompt_logprobs,
        )

    @staticmethod
    def _streamed(logprobs: list | None, num_new: int) -> list | None:
        return None if logprobs is None else logprobs[len(logprobs) - num_new :]
