"""The completions and chat endpoints' work: a request in, the engine's outputs out as OpenAI's responses.

A request's prompts (a completion may have several) become one engine request
each; its ``n`` choices come from the engine's ``n`` sequences, choice
``prompt * n + sequence``. A response is one JSON object, or with ``stream`` a
server-sent event per output (``data: {...}``) ending with ``data: [DONE]``.
However the work ends (done, an error, the client gone: its task cancelled),
the request's unfinished prompts are aborted, freeing their blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from jaxrunner.engine.chat import chat_messages
from jaxrunner.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxrunner.engine.prompts import PromptType, TokensPrompt
from jaxrunner.entrypoints.async_llm import AsyncLLM, EngineDeadError, RequestStream
from jaxrunner.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    engine_error,
)
from jaxrunner.interfaces import SamplingParams
from jaxrunner.lora.request import LoRARequest

# JSON has no infinity: vLLM's floor for a token the sampler ruled out.
_LOGPROB_FLOOR = -9999.0


def sse(data: Mapping[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_body(error: RequestError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.status}}


@dataclasses.dataclass
class _Choice:
    """One choice as its outputs arrive: what it has so far, or (streaming) what it has sent."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


class OpenAIServing:
    """Serves the model (and its LoRA adapters, by name) through ``engine``."""

    def __init__(self, engine: AsyncLLM, model_name: str, lora_requests: list[LoRARequest]):
        self.engine = engine
        self.model_name = model_name
        self.lora_requests = {lora.lora_name: lora for lora in lora_requests}

    # ------------------------------------------------------------ models

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the base model, then each adapter."""
        created = int(time.time())
        cards = [{"id": self.model_name, "object": "model", "created": created, "owned_by": "jaxrunner"}]
        cards += [
            {"id": name, "object": "model", "created": created, "owned_by": "jaxrunner", "parent": self.model_name}
            for name in self.lora_requests
        ]
        return {"object": "list", "data": cards}

    def _adapter(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name not served."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        raise RequestError(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")

    # ------------------------------------------------------------ endpoints

    async def completion(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """``POST /v1/completions``."""
        lora = self._adapter(request.model)
        params = request.to_sampling_params()
        prompts: list[PromptType] = list(request.prompts())
        if not prompts:
            raise RequestError("prompt is empty; give at least one prompt.", "prompt")
        response_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add(response_id, prompts, params, lora, "prompt")
        response = _Response(response_id, self._model_label(request.model), streams, params.n, request)
        return response.events() if request.stream else await response.collect()

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """``POST /v1/chat/completions``."""
        lora = self._adapter(request.model)
        params = request.to_sampling_params()
        prompt = self._render(request)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._add(response_id, [prompt], params, lora, "messages")
        response = _Response(response_id, self._model_label(request.model), streams, params.n, request)
        return response.events() if request.stream else await response.collect()

    def _model_label(self, model: str | None) -> str:
        return model or self.model_name

    def _render(self, request: ChatCompletionRequest) -> TokensPrompt:
        """The conversation through the tokenizer's chat template, as token ids (and its images)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("This server has no tokenizer to render a chat with; use /v1/completions.", "messages")
        for i, message in enumerate(request.messages):
            if not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] has no role.", f"messages.{i}.role")
            _check_image_urls(message.get("content"), f"messages.{i}.content")
        try:
            conversation, images = chat_messages(request.messages, "messages")
            encoded = tokenizer.apply_chat_template(
                conversation, tokenize=True, add_generation_prompt=request.add_generation_prompt
            )
        except Exception as error:  # the template's own errors (jinja2's, or raised by the template) included
            raise RequestError(f"messages: {error}", "messages") from None
        # tokenize=True: token ids, in a BatchEncoding (a Mapping) where the tokenizer returns a dict.
        ids = list(encoded["input_ids"]) if isinstance(encoded, Mapping) else cast(list[int], list(encoded))
        prompt: TokensPrompt = {"prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    async def _add(
        self,
        response_id: str,
        prompts: list[PromptType],
        params: SamplingParams,
        lora: LoRARequest | None,
        prompt_field: str,
    ) -> list[RequestStream]:
        """Queue the prompts, all or none: a refusal aborts those queued before it."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{response_id}-{i}", prompt, params, lora))
        except (ValueError, TypeError) as error:  # the engine's refusal (RequestRefusedError), or the prompt's form
            for stream in streams:
                stream.abort()
            where = prompt_field if len(prompts) == 1 else f"{prompt_field}.{len(streams)}"
            raise engine_error(str(error), where) from None
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams


def _check_image_urls(content: object, where: str) -> None:
    """Images come inline, as ``data:`` URLs: a client may not make the server read its own files (a path
    or ``file://`` URL, which the offline ``LLM.chat`` takes)."""
    if not isinstance(content, list):
        return
    for p, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") in ("image_url", "image_pil"):
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, Mapping) else None
            if not (isinstance(url, str) and url.startswith("data:")):
                raise RequestError(
                    f"{where}.{p}: an image must be an image_url part with a data: URL (base64) here.",
                    f"{where}.{p}",
                )


class _Response:
    """One response's choices, built from its prompts' outputs as they come."""

    def __init__(
        self,
        response_id: str,
        model: str,
        streams: list[RequestStream],
        n: int,
        request: CompletionRequest | ChatCompletionRequest,
    ):
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.streams = streams
        self.n = n
        self.request = request
        self.chat = isinstance(request, ChatCompletionRequest)
        self.top_logprobs = (
            request.top_logprobs if isinstance(request, ChatCompletionRequest) else request.logprobs
        ) or 0
        self.choices = [_Choice() for _ in range(len(streams) * n)]
        self.prompt_token_ids: list[list[int]] = [[] for _ in streams]

    # ------------------------------------------------------------ whole

    async def collect(self) -> dict[str, Any]:
        """The finished response."""
        async for prompt_index, output in self._outputs():
            for completion in output.outputs:
                choice = self.choices[prompt_index * self.n + completion.index]
                if completion.logprobs is not None:
                    choice.logprobs = (choice.logprobs or []) + self._logprobs(completion, len(choice.text))
                choice.text += completion.text
                choice.token_ids += completion.token_ids
                choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice_body(i, c) for i, c in enumerate(self.choices)],
            "usage": self._usage(),
        }
        if self.chat and self.request.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids[0]
        return body

    def _choice_body(self, index: int, choice: _Choice) -> dict[str, Any]:
        body: dict[str, Any] = {"index": index}
        if self.chat:
            body["message"] = {"role": "assistant", "content": choice.text}
        else:
            body["text"] = choice.text
        body["logprobs"] = self._logprobs_body(choice.logprobs)
        body["finish_reason"], body["stop_reason"] = choice.finish_reason, choice.stop_reason
        if self.request.return_token_ids:
            body["token_ids"] = choice.token_ids
            if not self.chat:
                body["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
        return body

    # ------------------------------------------------------------ streamed

    async def events(self) -> AsyncIterator[str]:
        """The response as server-sent events: a chunk per choice's new text, a usage chunk if asked
        for, then ``[DONE]``. An error on the engine's side ends the stream with an error event."""
        try:
            async for prompt_index, output in self._outputs():
                for completion in output.outputs:
                    index = prompt_index * self.n + completion.index
                    chunk = self._chunk(index, completion)
                    if chunk is not None:
                        yield sse(chunk)
            if self.request.include_usage:
                yield sse(self._chunk_body([]) | {"usage": self._usage()})
        except EngineDeadError as error:
            yield sse(error_body(RequestError(str(error), None, 500, "InternalServerError")))
        yield sse("[DONE]")

    def _chunk(self, index: int, completion: CompletionOutput) -> dict[str, Any] | None:
        """The chunk of one choice's new output; None if it brings nothing (a sequence of the prompt
        that did not advance, or finished before)."""
        choice = self.choices[index]
        if choice.finish_reason is not None or not (completion.token_ids or completion.finish_reason):
            return None
        body: dict[str, Any] = {"index": index}
        if self.chat:
            body["delta"] = {"content": completion.text}
            if not choice.started:
                body["delta"]["role"] = "assistant"
        else:
            body["text"] = completion.text
        logprobs = None
        if completion.logprobs is not None:
            logprobs = self._logprobs(completion, len(choice.text))
        body["logprobs"] = self._logprobs_body(logprobs)
        body["finish_reason"], body["stop_reason"] = completion.finish_reason, completion.stop_reason
        if self.request.return_token_ids:
            body["token_ids"] = completion.token_ids
            if not choice.started:
                body["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
        choice.started = True
        choice.text += completion.text
        choice.token_ids += completion.token_ids
        choice.finish_reason = completion.finish_reason
        return self._chunk_body([body])

    def _chunk_body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ------------------------------------------------------------ shared

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's outputs as they come, with the prompt's index; aborts the unfinished ones
        however it ends."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as error:
                queue.put_nowait((index, error))
            queue.put_nowait((index, None))

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(pumps)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self.prompt_token_ids[index] = item.prompt_token_ids
                yield index, item
        finally:
            for task in pumps:
                task.cancel()
            for stream in self.streams:
                stream.abort()

    def _usage(self) -> dict[str, int]:
        prompt_tokens = sum(len(ids) for ids in self.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _logprobs(self, completion: CompletionOutput, text_offset: int) -> list[dict[str, Any]]:
        """Each new token's logprob and top alternatives, ``text_offset`` where its text starts."""
        assert completion.logprobs is not None  # asked for: one entry per token
        entries = []
        for token_id, candidates in zip(completion.token_ids, completion.logprobs):
            chosen = candidates[token_id]
            top = sorted((c for c in candidates.items() if 1 <= _rank(c) <= self.top_logprobs), key=_rank)
            entries.append(
                {
                    "token": _token_text(token_id, chosen),
                    "logprob": max(chosen.logprob, _LOGPROB_FLOOR),
                    "top": [(_token_text(t, lp), max(lp.logprob, _LOGPROB_FLOOR)) for t, lp in top],
                    "offset": text_offset,
                }
            )
            text_offset += len(entries[-1]["token"])
        return entries

    def _logprobs_body(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """The logprobs in the endpoint's form: chat's ``content`` list, or the legacy completions lists."""
        if entries is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": e["token"],
                        "logprob": e["logprob"],
                        "bytes": list(e["token"].encode()),
                        "top_logprobs": [
                            {"token": token, "logprob": value, "bytes": list(token.encode())}
                            for token, value in e["top"]
                        ],
                    }
                    for e in entries
                ]
            }
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(e["top"]) for e in entries],
            "text_offset": [e["offset"] for e in entries],
        }


def _rank(item: tuple[int, Logprob]) -> int:
    return item[1].rank or 0


def _token_text(token_id: int, logprob: Logprob) -> str:
    """A token's text, or vLLM's ``token_id:N`` where there is no tokenizer to decode it."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"
