"""A dispatched step's output, read on the host only when asked for (async scheduling)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrunner.interfaces import AsyncModelRunnerOutput, LogprobsLists, ModelRunnerOutput
from jaxrunner.runner.input_batch import InputBatch
from jaxrunner.sample.logprobs import LogprobsTensors
from jaxrunner.sharding import host_copy
from jaxrunner.spans import Spans


class AsyncOutput(AsyncModelRunnerOutput):
    """A step's sampled tokens (and logprobs) as device arrays, copied to the host by ``get_output``.

    No copy is started at dispatch: under async scheduling the host asks only after
    it has dispatched the next step, so a copy started early would save the host
    nothing and cost it the time to start one.
    """

    def __init__(
        self,
        batch: InputBatch,
        tokens: jax.Array,
        logprobs: LogprobsTensors | None,
        prompt_logprobs: dict[str, tuple[int, LogprobsLists]],
        spans: Spans,
    ):
        """``tokens``: ``[rows, num_spec + 1]``; ``logprobs``: one row per logits row of them."""
        self.batch = batch
        self.tokens = tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.spans = spans
        # Given the sampled token lists once they are on the host: the runner's host-side
        # counts catch up on rejected drafts there.
        self.on_sampled: Callable[[list[list[int]]], None] | None = None

    def get_output(self) -> ModelRunnerOutput:
        """Wait for the step's tokens on the host and build its ``ModelRunnerOutput``."""
        with self.spans("get_output"):
            batch = self.batch
            with self.spans("device_wait"):
                tokens = host_copy(self.tokens)  # blocks until the step has run and its tokens are copied
            sampled = self._sampled_token_ids(tokens[: batch.num_reqs])
            if self.on_sampled is not None:
                self.on_sampled(sampled)
            return ModelRunnerOutput(
                req_ids=batch.req_ids,
                req_id_to_index=dict(zip(batch.req_ids, range(batch.num_reqs))),
                sampled_token_ids=sampled,
                logprobs=None if self.logprobs is None else self._logprobs_lists(self.logprobs, sampled),
                prompt_logprobs_dict=self.prompt_logprobs,
            )

    def _sampled_token_ids(self, rows: np.ndarray) -> list[list[int]]:
        """Each request's sampled tokens: its row's ids (-1 pads rejected drafts), none if it did not sample.

        Most steps every request samples and keeps its whole row: one ``tolist`` then.
        """
        is_sampling = self.batch.is_sampling_np
        if is_sampling.all() and rows.min(initial=0) >= 0:
            return rows.tolist()
        return [[t for t in row if t >= 0] if s else [] for row, s in zip(rows.tolist(), is_sampling.tolist())]

    def _logprobs_lists(self, logprobs: LogprobsTensors, sampled: list[list[int]]) -> LogprobsLists:
        """Sample logprobs of the tokens sampled: request row r's logits rows are
        ``r * (num_spec + 1)`` onwards, one per token it emitted."""
        width = self.tokens.shape[1]
        counts = np.fromiter(map(len, sampled), np.int64, len(sampled))
        keep = np.repeat(np.arange(len(sampled)) * width, counts) + (
            np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        return LogprobsLists(
            logprob_token_ids=host_copy(logprobs.token_ids)[keep],
            logprobs=host_copy(logprobs.logprobs)[keep],
            sampled_token_ranks=host_copy(logprobs.ranks)[keep],
            cu_num_generated_tokens=np.concatenate([[0], np.cumsum(counts)]).tolist(),
        )
