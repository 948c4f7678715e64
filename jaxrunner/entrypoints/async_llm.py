"""``AsyncLLM``: the engine behind an asynchronous front, as vLLM's, for servers.

One thread, the engine thread, owns the engines: JAX and the engine are not
thread-safe, so nothing else touches them. Adds and aborts reach it as commands
through a thread-safe queue; it runs them between steps, steps while any request
is unfinished and sleeps on a condition otherwise. Requests from every client
are batched together by the engine's scheduler as the offline ``LLM``'s are.
Each request's outputs (``RequestOutputKind.DELTA``: what is new since the last)
go to its own ``asyncio.Queue`` on the event loop that added it, through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from jaxrunner.engine.llm import LLM
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.engine.prompts import ParsedPrompt, PromptType, parse_prompt
from jaxrunner.entrypoints.metrics import IterationStats, SchedulerStats, StatLogger
from jaxrunner.interfaces import RequestOutputKind, SamplingParams
from jaxrunner.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a step failed): no request can run."""


class RequestRefusedError(ValueError):
    """The engine refused a request (an empty or too long prompt, parameters it cannot hold, an adapter
    that cannot be read); the message says why. Other requests are not affected."""


@dataclasses.dataclass
class _Listener:
    """Where one request's outputs go: a queue on the event loop that added it; and, on the engine
    thread, when its last token came (for the latency metrics)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    last_token_time: float | None = None


class RequestStream:
    """One request's outputs as they come (``async for``), each with only what is new; ends after the
    finished one. ``abort()`` ends it early and frees the request's blocks."""

    def __init__(self, request_id: str, listener: _Listener, abort: Callable[[str], None]):
        self.request_id = request_id
        self._queue = listener.queue
        self._abort = abort
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort the request unless it has finished (a client that left, an error on our side)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncLLM:
    """An ``LLM``'s engines driven by a thread of their own, taking requests from any number of asyncio
    tasks at once.

    ``await add_request(...)`` returns the request's ``RequestStream`` once the engine has queued it, or
    raises ``RequestRefusedError`` if the engine refused it; ``generate`` is the same as an async
    generator, aborting the request if its consumer stops early. ``stat_loggers`` get the scheduler's
    state and the new tokens' counts and latencies after every turn of the engine loop.
    """

    def __init__(self, llm: LLM, stat_loggers: Sequence[StatLogger] = ()):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.llm_engine.max_model_len
        self.stat_loggers = list(stat_loggers)
        self.dead: BaseException | None = None
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._listeners: dict[str, _Listener] = {}  # the engine thread's only
        self._thread = threading.Thread(target=self._run, name="jaxrunner-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ callers' side

    @property
    def is_running(self) -> bool:
        """Whether the engine thread takes requests."""
        return self.dead is None

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a prompt; its stream once the engine has taken it. ``TypeError`` / ``ValueError`` for a
        prompt of no known form, ``RequestRefusedError`` if the engine refuses it, ``EngineDeadError``
        if the engine has stopped."""
        parsed = parse_prompt(prompt)
        loop = asyncio.get_running_loop()
        listener = _Listener(loop, asyncio.Queue())
        verdict: asyncio.Future[None] = loop.create_future()
        self._submit(lambda: self._add(request_id, parsed, params, lora_request, listener, verdict))
        try:
            await verdict
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: the engine thread runs commands in order
            raise
        return RequestStream(request_id, listener, self.abort)

    async def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: the request's outputs as they come; closing the generator early
        (or cancelling its consumer) aborts the request."""
        stream = await self.add_request(request_id, prompt, params, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request: the engine thread finishes it and frees its blocks at its next turn (between
        steps); it sends no more outputs. Safe from any thread; unknown or finished ids are ignored."""
        self._submit(lambda: self._abort(request_id))

    def shutdown(self) -> None:
        """Stop the engine thread after its current step; unfinished requests are aborted and their
        streams raise ``EngineDeadError``."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._wake:
            if self.dead is not None:
                raise EngineDeadError(f"The engine has stopped: {self.dead}")
            self._commands.append(command)
            self._wake.notify()

    # ------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        replicas = self.llm.replicas
        try:
            while True:
                with self._wake:
                    while not (self._commands or self._stopping or replicas.has_unfinished_requests()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command()
                outputs = replicas.step() if replicas.has_unfinished_requests() else []
                self._record(self._deliver(outputs))
        except BaseException as error:
            logger.exception("The engine loop failed; no request can run.")
            self.dead = error
        finally:
            self._stop()

    def _add(
        self,
        request_id: str,
        prompt: ParsedPrompt,
        params: SamplingParams,
        lora_request: LoRARequest | None,
        listener: _Listener,
        verdict: asyncio.Future[None],
    ) -> None:
        if self.dead is not None:  # a command left when the engine stopped
            _call_soon(listener.loop, _settle, verdict, EngineDeadError(f"The engine has stopped: {self.dead}"))
            return
        engine = self.llm.replicas.assign(1)[0]
        try:
            result = engine.prepare_request(request_id, prompt, params, lora_request)
            if isinstance(result, RequestOutput):
                raise RequestRefusedError(result.error)
            engine.add_prepared(result, RequestOutputKind.DELTA)
        except Exception as error:  # this request's alone: the engine has undone its add
            _call_soon(listener.loop, _settle, verdict, error)
            return
        self._listeners[request_id] = listener
        _call_soon(listener.loop, _settle, verdict, None)

    def _abort(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)
        self.llm.replicas.abort_request([request_id], internal=True)

    def _deliver(self, outputs: list[RequestOutput]) -> IterationStats:
        """Send each output to its request's queue; the turn's token counts and latencies."""
        stats = IterationStats()
        now = time.monotonic()
        for output in outputs:
            listener = self._listeners.get(output.request_id)
            if listener is None:
                continue
            if output.finished:
                del self._listeners[output.request_id]
            stats.observe(output, listener.last_token_time, now)
            if any(c.token_ids for c in output.outputs):
                listener.last_token_time = now
            if not _call_soon(listener.loop, listener.queue.put_nowait, output):
                self._abort(output.request_id)  # its event loop has closed
        return stats

    def _record(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        state = SchedulerStats.of(self.llm.replicas.engines)
        for stat_logger in self.stat_loggers:
            stat_logger.record(state, iteration)

    def _stop(self) -> None:
        """The thread's last work: adds still queued refused, every request aborted, every stream told
        that the engine has stopped."""
        with self._wake:
            self.dead = self.dead or EngineDeadError("shut down")
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            command()
        error = EngineDeadError(f"The engine has stopped: {self.dead}")
        for request_id, listener in self._listeners.items():
            with contextlib.suppress(Exception):  # a failed step has aborted them already
                self.llm.replicas.abort_request([request_id], internal=True)
            _call_soon(listener.loop, listener.queue.put_nowait, error)
        self._listeners.clear()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: object) -> bool:
    """Run ``callback(*args)`` on ``loop``'s thread; False if the loop has closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _settle(verdict: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolve an add's verdict, unless its waiter has gone (cancelled)."""
    if verdict.done():
        return
    if error is None:
        verdict.set_result(None)
    else:
        verdict.set_exception(error)
