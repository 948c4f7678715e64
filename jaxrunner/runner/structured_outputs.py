"""Structured output on the runner's side: the step's grammar bitmask, in batch row order."""

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
    """The sampling program's grammar inputs: a bitmask row and an on/off flag per batch row.

    Steps without a grammar reuse an all-off pair per request bucket, resident on
    the device, so they transfer nothing.
    """

    def __init__(self, request_buckets: list[int], vocab_size: int, sharding: jax.sharding.Sharding):
        self.words = bitmask_words(vocab_size)
        self._unused = {
            b: jax.device_put((np.zeros((b, self.words), np.int32), np.zeros(b, np.bool_)), sharding)
            for b in request_buckets
        }

    def rows(self, batch: InputBatch, grammar_output: GrammarOutput | None) -> tuple:
        """(bitmask ``[bucket, words]``, active ``[bucket]``) in ``batch``'s row order."""
        bucket = batch.num_reqs_after_padding
        if not uses_grammar(grammar_output):
            return self._unused[bucket]
        assert grammar_output is not None
        row_of = {r: i for i, r in enumerate(batch.req_ids)}
        bitmask = np.zeros((bucket, self.words), np.int32)
        active = np.zeros(bucket, np.bool_)
        for req_id, words in zip(grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask):
            if req_id in row_of:
                bitmask[row_of[req_id], : len(words)] = words
                active[row_of[req_id]] = True
        return bitmask, active
