"""Data parallelism: independent engine replicas in one process, requests spread across them.

Each replica is a whole ``LLMEngine`` (scheduler, KV cache, runner) on its own
row of the ``(data, model)`` mesh. The replicas are stepped in turn; with
async scheduling each has its next step dispatched before it waits for its
last, so JAX's asynchronous dispatch runs the replicas at the same time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jaxrunner.engine.llm_engine import LLMEngine
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.interfaces import RequestOutputKind, SamplingParams


class DataParallelEngines:
    """``LLMEngine`` replicas behind one request interface; request ids are unique across them."""

    def __init__(self, engines: Sequence[LLMEngine]):
        self.engines = list(engines)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        """A request id no replica has used."""
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> RequestOutput | None:
        """Queue a prompt on the replica with the fewest unfinished prompts (ties: the first, so a batch
        is dealt round-robin); returns an error output instead if the request is invalid."""
        engine = min(self.engines, key=lambda e: e.num_unfinished_prompts)
        return engine.add_request(request_id, prompt, params)

    def has_unfinished_requests(self) -> bool:
        """Whether any replica has a request waiting or running."""
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> list[RequestOutput]:
        """One step of every replica with work, in turn.

        With async scheduling each replica dispatches its next step before it waits
        for its last one, so while one replica waits the others' devices are busy.
        """
        return [output for e in self.engines if e.has_unfinished_requests() for output in e.step(output_kind)]
