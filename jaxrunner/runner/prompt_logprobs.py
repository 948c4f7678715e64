"""Prompt logprobs: the requests that asked for them, and each step's program call that scores their prompts.

The token at position p predicts prompt token p + 1, so a step that computes a
request's prompt positions [first, end) scores prompt tokens first + 1 .. end,
from the forward's hidden states of those tokens.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrunner.interfaces import LogprobsLists, NewRequestData
from jaxrunner.runner.compilation import CompiledPrograms
from jaxrunner.runner.input_batch import InputBatch
from jaxrunner.runner.step_functions import ParamLeaves
from jaxrunner.sharding import host_copy
from jaxrunner.spans import Spans


class PromptLogprobs:
    """Per-request state (prompt, top count) of the requests that asked for prompt logprobs."""

    def __init__(self, programs: CompiledPrograms, spans: Spans):
        self.programs = programs  # by token bucket
        self.spans = spans
        self._requests: dict[str, tuple[np.ndarray, int]] = {}

    def add_request(self, new_req: NewRequestData, slot: int) -> None:
        k = new_req.sampling_params.prompt_logprobs
        if k is not None:
            self._requests[new_req.req_id] = (np.asarray(new_req.prompt_token_ids, np.int32), k)

    def remove_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def compute(
        self, batch: InputBatch, hidden: jax.Array, num_computed_tokens: np.ndarray, params: ParamLeaves
    ) -> dict[str, tuple[int, LogprobsLists]]:
        """Raw logprobs of the prompt tokens this step's chunks predict, per asking request.

        Each entry is (position of the first prompt token predicted, its rows).
        ``num_computed_tokens`` is by slot, before this step.
        """
        if not self._requests:
            return {}
        spans = []
        start = 0
        for req_id, slot, n in zip(batch.req_ids, batch.idx_mapping_np, batch.num_scheduled_tokens):
            entry = self._requests.get(req_id)
            if entry is not None:
                prompt, k = entry
                computed = int(num_computed_tokens[slot])
                end = min(computed + int(n), len(prompt) - 1)
                if end > computed:
                    spans.append((req_id, start, computed, end, prompt, k))
            start += int(n)
        if not spans:
            return {}
        size = batch.num_tokens_after_padding
        targets, counts = np.zeros(size, np.int32), np.zeros(size, np.int32)
        for _, start, first, end, prompt, k in spans:
            targets[start : start + end - first] = prompt[first + 1 : end + 1]
            counts[start : start + end - first] = k + 1
        program = self.programs.get(size)
        with self.spans("program_call"):
            out = program(params, hidden, targets, counts)
        ids, lps, ranks = (host_copy(a) for a in (out.token_ids, out.logprobs, out.ranks))
        result = {}
        for req_id, start, first, end, _, k in spans:
            rows = slice(start, start + end - first)
            result[req_id] = (first + 1, LogprobsLists(ids[rows, : k + 1], lps[rows, : k + 1], ranks[rows]))
        return result
