"""The OpenAI-compatible HTTP server, as vLLM's ``vllm serve``: FastAPI routes over an ``AsyncLLM``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as
server-sent events with ``stream``), ``GET /v1/models`` (the model and its LoRA
adapters, which requests name as their ``model``), ``GET /health`` (503 once
the engine has stopped) and ``GET /metrics`` (Prometheus text). With an API key
every ``/v1`` route needs ``Authorization: Bearer <key>``. Errors are OpenAI's
error object: 400 naming the field for a bad request, 404 for an unknown model.
A client that disconnects has its request aborted at once.
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


def build_app(
    llm: LLM, served_model_name: str, lora_requests: Sequence[LoRARequest] = (), api_key: str | None = None
) -> FastAPI:
    """The server's app over ``llm``'s engines, which it drives from now on (``app.state.engine``, an
    ``AsyncLLM``) until the app shuts down."""
    stat_logger = PrometheusStatLogger(served_model_name)
    engine = AsyncLLM(llm, [stat_logger])
    serving = OpenAIServing(engine, served_model_name, list(lora_requests))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.shutdown)

    async def authenticate(request: Request) -> None:
        given = request.headers.get("Authorization", "")
        if api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError("Invalid or missing API key.", None, 401, "AuthenticationError")

    async def request_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestError)  # registered for it alone
        return _error_response(error)

    app = FastAPI(title="jaxrunner", lifespan=lifespan, exception_handlers={RequestError: request_error})
    app.state.engine = engine
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models() -> Response:
        return JSONResponse(serving.models())

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await _respond(request, CompletionRequest, serving.completion)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _respond(request, ChatCompletionRequest, serving.chat)

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
    llm: LLM,
    served_model_name: str,
    lora_requests: Sequence[LoRARequest] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
) -> None:
    """Serve ``llm`` until interrupted (Ctrl-C: open responses get ``GRACEFUL_SHUTDOWN_S`` to finish,
    then the engine thread stops)."""
    app = build_app(llm, served_model_name, lora_requests, api_key)
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_level="info")
