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


class DataParallelEngines:
    """``LLMEngine`` replicas behind one request interface; request ids are unique across them."""

    def __init__(self, engines: Sequence[LLMEngine]):
        self.engines = list(engines)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        """A request id no replica has used."""
        return str(next(self._ids))

    def assign(self, num_prompts: int) -> list[LLMEngine]:
        """The replica for each of the next ``num_prompts`` prompts: the one with the fewest unfinished
        prompts, counting those assigned before it (ties: the first, so a batch is dealt round-robin)."""
        load = {id(e): e.num_unfinished_prompts for e in self.engines}
        assigned = []
        for _ in range(num_prompts):
            engine = min(self.engines, key=lambda e: load[id(e)])
            load[id(engine)] += 1
            assigned.append(engine)
        return assigned

    def abort_request(self, request_ids: Sequence[str], internal: bool = False) -> None:
        """Abort the prompts ``request_ids`` on whichever replica holds them (``LLMEngine.abort_request``)."""
        for engine in self.engines:
            engine.abort_request(request_ids, internal)

    @property
    def unfinished_prompt_ids(self) -> list[str]:
        """The request ids of every replica's prompts added and not finished yet."""
        return [request_id for e in self.engines for request_id in e.unfinished_prompt_ids]

    def has_unfinished_requests(self) -> bool:
        """Whether any replica has a request waiting or running (or an aborted prompt's output to return)."""
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, in turn.

        With async scheduling each replica dispatches its next step before it waits
        for its last one, so while one replica waits the others' devices are busy.
        """
        return [output for e in self.engines if e.has_unfinished_requests() for output in e.step()]
