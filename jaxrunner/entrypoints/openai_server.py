"""The OpenAI-compatible HTTP server, as vLLM's ``vllm serve``: FastAPI routes over an ``AsyncLLM``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as
server-sent events with ``stream``), ``GET /v1/models`` (the model and its LoRA
adapters, which requests name as their ``model``), ``GET /health`` (503 while
the model loads and once the engine has stopped) and ``GET /metrics``
(Prometheus text). The server listens while the model loads (``jaxrunner serve``
loads it on a thread): until it is ready every ``/v1`` route answers 503. With an
API key every ``/v1`` route needs ``Authorization: Bearer <key>``. Errors are
OpenAI's error object: 400 naming the field for a bad request, 404 for an
unknown model, 503 while loading. A client that disconnects has its request
aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pydantic
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxrunner.engine.llm import LLM
from jaxrunner.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxrunner.entrypoints.metrics import PrometheusStatLogger
from jaxrunner.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    validation_error,
)
from jaxrunner.entrypoints.serving import OpenAIServing, error_body
from jaxrunner.lora.request import LoRARequest

GRACEFUL_SHUTDOWN_S = 5
"""How long a stopping server (Ctrl-C) lets open responses finish before it cancels them."""


class _Engine:
    """The app's engine and routes' logic once the model has loaded (None before), or why it failed to load."""

    def __init__(self) -> None:
        self.engine: AsyncLLM | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: BaseException | None = None

    def ready(self) -> OpenAIServing:
        """The routes' logic; a 503 while the model loads, or if it failed to."""
        if self.serving is not None:
            return self.serving
        if self.load_error is not None:
            message = f"The model failed to load: {self.load_error!r}; see the server's log, fix it and restart."
        else:
            message = "The model is still loading; retry once GET /health answers 200."
        raise RequestError(message, None, 503, "ServiceUnavailableError")


def build_app(
    llm: LLM | Callable[[], LLM],
    served_model_name: str,
    lora_requests: Sequence[LoRARequest] = (),
    api_key: str | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The server's app over ``llm``'s engines, which it drives from now on (``app.state.engine``, an
    ``AsyncLLM``) until the app shuts down. Given a function that makes the ``LLM``, the app calls it on a
    thread when it starts and answers 503 until it returns; if it raises, ``on_load_error`` gets the error."""
    stat_logger = PrometheusStatLogger(served_model_name)
    state = _Engine()

    def load(made: LLM) -> None:
        engine = AsyncLLM(made, [stat_logger])
        state.serving = OpenAIServing(engine, served_model_name, list(lora_requests))
        state.engine = app.state.engine = engine

    def load_in_background(make: Callable[[], LLM]) -> None:
        try:
            load(make())
        except BaseException as error:  # reported by 503s and to the caller; the server stays up to say so
            state.load_error = error
            if on_load_error is not None:
                on_load_error(error)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None if isinstance(llm, LLM) else asyncio.ensure_future(asyncio.to_thread(load_in_background, llm))
        yield
        if loading is not None:
            await loading
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    async def authenticate(request: Request) -> None:
        given = request.headers.get("Authorization", "")
        if api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError("Invalid or missing API key.", None, 401, "AuthenticationError")

    async def request_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestError)  # registered for it alone
        return _error_response(error)

    app = FastAPI(title="jaxrunner", lifespan=lifespan, exception_handlers={RequestError: request_error})
    app.state.engine = None
    if isinstance(llm, LLM):
        load(llm)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine is not None and state.engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models() -> Response:
        return JSONResponse(state.ready().models())

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await _respond(request, CompletionRequest, state.ready().completion)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _respond(request, ChatCompletionRequest, state.ready().chat)

    app.include_router(v1)
    return app


async def _respond(
    request: Request,
    model: type[pydantic.BaseModel],
    handler: Callable[[Any], Awaitable[dict[str, Any] | AsyncIterator[str]]],
) -> Response:
    """Validate the body as ``model``, run ``handler`` on it, and send its result: a JSON body, or
    server-sent events. A non-streamed request whose client disconnects is cancelled, which aborts it
    (a stream is cancelled by the response itself)."""
    try:
        body = model.model_validate_json(await request.body())
        result = await _cancelled_on_disconnect(request, handler(body))
    except pydantic.ValidationError as error:
        return _error_response(validation_error(error))
    except EngineDeadError as error:
        return _error_response(RequestError(str(error), None, 503, "ServiceUnavailableError"))
    if result is None:  # the client has gone: no one to answer (nginx's "client closed request")
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


async def _cancelled_on_disconnect(request: Request, work: Awaitable[Any]) -> Any | None:
    """``work``'s result; or, when the client disconnects first, None with ``work`` cancelled (vLLM's
    ``with_cancellation``)."""
    work_task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work_task, disconnect], return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if not work_task.done():
        work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        return None
    return work_task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read: only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)


def serve(
    make_llm: Callable[[], LLM],
    served_model_name: str,
    lora_requests: Sequence[LoRARequest] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
) -> None:
    """Listen at once and serve the ``LLM`` that ``make_llm`` makes (503 until it has) until interrupted
    (Ctrl-C: open responses get ``GRACEFUL_SHUTDOWN_S`` to finish, then the engine thread stops). A model
    that fails to load stops the server, and its error is raised here."""
    failed: list[BaseException] = []

    def stop(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True

    app = build_app(make_llm, served_model_name, lora_requests, api_key, on_load_error=stop)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_level="info")
    server = uvicorn.Server(config)
    server.run()
    if failed:
        raise failed[0]
