"""Output processing: each step's new tokens become ``RequestOutput``s.

It keeps, per prompt, what the scheduler does not: the text of each of its
``n`` sequences (incremental detokenization, stop strings), their sample and
prompt logprobs, the tokens already streamed, and the grammar matchers it
advances. A sequence that a stop string or its grammar ends is finished in
the scheduler at once. vLLM's ``v1/engine/output_processor.py`` does this job
there.
"""

from __future__ import annotations

import contextlib
import dataclasses

from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.engine.structured_outputs import StructuredOutputManager
from jaxrunner.interfaces import ModelRunnerOutput, RequestOutputKind, SamplingParams
from jaxrunner.lora.request import LoRARequest


def refused_output(
    request_id: str, prompt: str | None, token_ids: list[int], error: str, lora_request: LoRARequest | None = None
) -> RequestOutput:
    """The finished output of a request the engine refused, ``error`` saying why."""
    return RequestOutput(
        request_id,
        prompt,
        token_ids,
        [CompletionOutput(0, "", [], finish_reason="error")],
        finished=True,
        error=error,
        lora_request=lora_request,
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
    output_kind: RequestOutputKind
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        """Whether every sequence of the prompt has finished."""
        return all(s.request.is_finished for s in self.sequences)


class OutputProcessor:
    """The output side of the prompts in flight, from ``add_prompt`` until their last output."""

    def __init__(self, scheduler: Scheduler, tokenizer, structured_outputs: StructuredOutputManager | None):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.structured_outputs = structured_outputs
        self._prompts: dict[str, _Prompt] = {}
        # Each running sequence's request id -> its prompt and its sequence.
        self._by_request_id: dict[str, tuple[_Prompt, _Sequence]] = {}

    @property
    def num_prompts(self) -> int:
        """Prompts added and not finished yet."""
        return len(self._prompts)

    @property
    def prompt_ids(self) -> list[str]:
        """The request ids of the prompts added and not finished yet."""
        return list(self._prompts)

    def add_prompt(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: list[int],
        requests: list[Request],
        output_kind: RequestOutputKind,
    ) -> None:
        """Track a prompt's sequences (``requests``, one per sequence) until they finish; ``output_kind``
        says which of its outputs ``process`` returns (vLLM's ``SamplingParams.output_kind``): DELTA only
        what is new since the last one (streaming), FINAL_ONLY only the finished prompt's, CUMULATIVE
        everything so far."""
        params = requests[0].sampling_params
        sequences = [
            _Sequence(
                request, self._detokenizer(token_ids, params), logprobs=[] if params.logprobs is not None else None
            )
            for request in requests
        ]
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None for _ in token_ids]
        entry = _Prompt(request_id, prompt, token_ids, sequences, output_kind, prompt_logprobs)
        self._prompts[request_id] = entry
        for seq in sequences:
            self._by_request_id[seq.request.request_id] = (entry, seq)

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, stop=list(params.stop or ()))

    def abort(self, request_id: str, final_output: bool) -> RequestOutput | None:
        """Finish prompt ``request_id``'s unfinished sequences as aborted (the scheduler frees their
        blocks) and stop tracking it; returns its final output if ``final_output`` (finish reason
        "abort" on those sequences, as vLLM's), else None. Unknown prompts are ignored."""
        entry = self._prompts.get(request_id)
        if entry is None:
            return None
        self.scheduler.finish_requests([s.request.request_id for s in entry.sequences], RequestStatus.FINISHED_ABORTED)
        output = self._make_output(entry) if final_output else None
        self._release(entry)
        return output

    def abort_all(self) -> list[RequestOutput]:
        """After a step that was cut short: every prompt's unfinished sequences marked aborted (the engine
        resets the scheduler itself), nothing tracked any more; returns the prompts' final outputs. An
        output that cannot be built from a sequence left half updated is left out."""
        outputs = []
        for entry in list(self._prompts.values()):
            for seq in entry.sequences:
                if not seq.request.is_finished:
                    seq.request.finish(RequestStatus.FINISHED_ABORTED)
            with contextlib.suppress(Exception):
                outputs.append(self._make_output(entry))
            self._release(entry)
        return outputs

    def process(
        self, runner_output: ModelRunnerOutput, updates: list[tuple[Request, list[int]]]
    ) -> list[RequestOutput]:
        """Apply one step's new tokens (``Scheduler.update_from_output``'s ``updates``): logprobs,
        grammars, text and stop strings; the outputs of the prompts they advanced or finished, each
        as its output kind asks (``add_prompt``).
        """
        touched: dict[str, _Prompt] = {}
        ending: set[str] = set()  # prompts with a sequence that finished in this update
        self._record_prompt_logprobs(runner_output)
        logprob_rows = self._logprob_rows(runner_output)
        has_grammars = self.structured_outputs is not None and self.structured_outputs.num_requests > 0
        for request, new_tokens in updates:
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
        outputs = []
        for entry in touched.values():
            finished = entry.request_id in ending and entry.finished
            if finished or entry.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(entry))
            if finished:
                self._release(entry)
        return outputs

    # ------------------------------------------------------------ logprobs

    @staticmethod
    def _logprob_rows(runner_output: ModelRunnerOutput) -> dict[str, range]:
        if runner_output.logprobs is None:
            return {}
        cu = runner_output.logprobs.cu_num_generated_tokens
        assert cu is not None  # the runner's sample logprobs always carry their offsets
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
        # Only a sequence that asked for logprobs (seq.logprobs set from them), in a step that returned some, gets here.
        assert lists is not None and count is not None and seq.logprobs is not None
        for row in rows:
            entry = self._logprob_dict(
                lists.logprob_token_ids[row], lists.logprobs[row], int(lists.sampled_token_ranks[row]), count
            )
            seq.logprobs.append(entry)
            seq.cumulative_logprob += float(lists.logprobs[row][0])

    def _record_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        for req_id, (first, lists) in runner_output.prompt_logprobs_dict.items():
            entry, _ = self._by_request_id.get(req_id, (None, None))
            if entry is None or entry.prompt_logprobs is None or entry.sequences[0].request.request_id != req_id:
                continue
            count = entry.sequences[0].request.sampling_params.prompt_logprobs
            assert count is not None  # entry.prompt_logprobs is set only when they were asked for
            for i in range(len(lists.logprobs)):
                entry.prompt_logprobs[first + i] = self._logprob_dict(
                    lists.logprob_token_ids[i], lists.logprobs[i], int(lists.sampled_token_ranks[i]), count
                )

    # ------------------------------------------------------ stop conditions

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

    # -------------------------------------------------------------- outputs

    def _release(self, entry: _Prompt) -> None:
        """Stop tracking a prompt; what an add cut short did not register yet is skipped."""
        self._prompts.pop(entry.request_id, None)
        for seq in entry.sequences:
            self._by_request_id.pop(seq.request.request_id, None)
            if self.structured_outputs is not None:
                self.structured_outputs.remove_request(seq.request.request_id)

    def _make_output(self, entry: _Prompt) -> RequestOutput:
        delta = entry.output_kind == RequestOutputKind.DELTA
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
            logprobs = seq.logprobs
            if delta and logprobs is not None:
                logprobs = logprobs[len(logprobs) - len(token_ids) :]
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        first = [s.request.first_token_time for s in entry.sequences if s.request.first_token_time]
        done = [s.request.finished_time for s in entry.sequences if s.request.finished_time]
        metrics = RequestMetrics(
            arrival_time=entry.sequences[0].request.arrival_time,
            first_token_time=min(first) if first else None,
            finished_time=max(done) if entry.finished and done else None,
            num_generated_tokens=max(len(s.request.output_token_ids) for s in entry.sequences),
        )
        return RequestOutput(
            entry.request_id,
            entry.prompt,
            entry.prompt_token_ids,
            completions,
            entry.finished,
            metrics,
            prompt_logprobs=entry.prompt_logprobs,
            lora_request=entry.sequences[0].request.lora_request,
        )
