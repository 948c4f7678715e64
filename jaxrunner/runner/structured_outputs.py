"""Structured output on the runner's side: the step's grammar bitmask, in logits row order."""

from __future__ import annotations

import jax
import numpy as np

from jaxrunner.interfaces import GrammarOutput
from jaxrunner.runner.input_batch import InputBatch
from jaxrunner.sample.sampling_state import bitmask_words


def uses_grammar(grammar_output: GrammarOutput | None) -> bool:
    """Whether any request of the step is constrained by a grammar."""
    return grammar_output is not None and bool(grammar_output.structured_output_request_ids)


class GrammarBitmask:
    """The sampling program's grammar inputs: a bitmask row and an on/off flag per logits row.

    Each request row has ``num_spec + 1`` logits rows (one without speculative
    decoding): row j scores the token after its draft j - 1. Steps without a
    grammar reuse an all-off pair per request bucket, resident on the device, so
    they transfer nothing.
    """

    def __init__(self, request_buckets: list[int], vocab_size: int, num_spec: int, sharding: jax.sharding.Sharding):
        self.words = bitmask_words(vocab_size)
        self.rows_per_request = num_spec + 1
        self._unused = {
            b: jax.device_put(
                (
                    np.zeros((b * self.rows_per_request, self.words), np.int32),
                    np.zeros(b * self.rows_per_request, bool),
                ),
                sharding,
            )
            for b in request_buckets
        }

    def rows(self, batch: InputBatch, grammar_output: GrammarOutput | None) -> tuple:
        """(bitmask ``[bucket * (num_spec + 1), words]``, active ``[bucket * (num_spec + 1)]``).

        ``grammar_output`` holds vLLM's layout: for each constrained request in its
        order, a row for its next token and one after each of its scheduled drafts.
        """
        bucket = batch.num_reqs_after_padding
        if not uses_grammar(grammar_output):
            return self._unused[bucket]
        assert grammar_output is not None
        row_of = {r: i for i, r in enumerate(batch.req_ids)}
        width = self.rows_per_request
        bitmask = np.zeros((bucket * width, self.words), np.int32)
        active = np.zeros(bucket * width, np.bool_)
        source = 0
        for req_id in grammar_output.structured_output_request_ids:
            row = row_of.get(req_id)
            count = 1 if row is None else 1 + int(batch.num_drafts[row])
            if source + count > len(grammar_output.grammar_bitmask):
                raise ValueError(
                    f"The grammar bitmask has {len(grammar_output.grammar_bitmask)} rows; request {req_id!r} "
                    "needs one for its next token and one after each of its scheduled drafts."
                )
            if row is not None:
                words = grammar_output.grammar_bitmask[source : source + count]
                bitmask[row * width : row * width + count, : words.shape[1]] = words
                active[row * width : row * width + count] = True
            source += count
        return bitmask, active
