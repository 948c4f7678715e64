"""The engine loop: requests in, one scheduler/runner step at a time, outputs out.

It owns the per-request output side that the scheduler does not: turning
tokens into text incrementally, stop strings, ``n > 1`` fan-out, and the
``RequestOutput`` objects. A bad request is refused with an error output of
its own; it never reaches the scheduler or the runner.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

from jaxrunner.detokenizer import IncrementalDetokenizer
from jaxrunner.interfaces import ModelRunnerOutput, SamplingParams
from jaxrunner.model_runner import ModelRunner
from jaxrunner.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxrunner.request import Request, RequestStatus
from jaxrunner.scheduler import Scheduler


@dataclasses.dataclass
class _Sequence:
    """One generated sequence of a prompt (``n`` of them per prompt)."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    num_streamed_tokens: int = 0


@dataclasses.dataclass
class _Prompt:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    """Runs requests to completion over a ``Scheduler`` and a ``ModelRunner``."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer=None):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.max_model_len = runner.max_model_len
        self._prompts: dict[str, _Prompt] = {}
        self._child_to_prompt: dict[str, _Prompt] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------- requests

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> RequestOutput | None:
        """Queue a prompt; returns a finished error output instead if the request is invalid."""
        prompt_text = prompt if isinstance(prompt, str) else None
        try:
            token_ids = self._tokenize(prompt)
            self._validate(token_ids, params)
        except ValueError as error:
            return RequestOutput(
                request_id, prompt_text, [], [CompletionOutput(0, "", [], finish_reason="error")],
                finished=True, error=str(error),
            )
        arrival = time.monotonic()
        sequences = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = Request(child_id, token_ids, child_params, self.eos_token_id, arrival_time=arrival)
            sequences.append(_Sequence(request, self._detokenizer(token_ids, child_params)))
        entry = _Prompt(request_id, prompt_text, token_ids, sequences, arrival)
        self._prompts[request_id] = entry
        for seq in sequences:
            self._child_to_prompt[seq.request.request_id] = entry
            self.scheduler.add_request(seq.request)
        return None

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
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to detect stop strings.")

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, stop=list(params.stop))

    def abort_request(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            entry = self._prompts.get(request_id)
            if entry is not None:
                self.scheduler.finish_requests(
                    [s.request.request_id for s in entry.sequences], RequestStatus.FINISHED_ABORTED
                )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----------------------------------------------------------------- step

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """One scheduler + runner step; outputs of the prompts that advanced or finished.

        With ``delta`` each output's text is only what is new since the last one
        (for streaming); otherwise it is the whole text so far.
        """
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens > 0:
            runner_output = self.runner.sample_tokens(None)
        elif runner_output is None:
            runner_output = ModelRunnerOutput.make_empty()
        touched: dict[str, _Prompt] = {}
        for request, new_tokens in self.scheduler.update_from_output(scheduler_output, runner_output):
            entry = self._child_to_prompt[request.request_id]
            seq = next(s for s in entry.sequences if s.request is request)
            stop_str = None
            if seq.detokenizer is not None:
                # A stop token id (or EOS) ends the text without its own text, as in vLLM.
                by_token = request.status == RequestStatus.FINISHED_STOPPED
                stop_str = seq.detokenizer.update(
                    new_tokens, finished=request.is_finished, stop_terminated=by_token
                )
            if stop_str is not None:
                self._stop_on_string(request, stop_str)
            touched[entry.request_id] = entry
        outputs = [self._make_output(entry, delta) for entry in touched.values()]
        for entry in touched.values():
            if entry.finished:
                self._release(entry)
        return outputs

    def _stop_on_string(self, request: Request, stop_str: str) -> None:
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        request.stop_reason = stop_str

    def _release(self, entry: _Prompt) -> None:
        del self._prompts[entry.request_id]
        for seq in entry.sequences:
            del self._child_to_prompt[seq.request.request_id]

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
            entry.request_id, entry.prompt, entry.prompt_token_ids, completions, entry.finished, metrics
        )
