"""The OpenAI API's requests, with vLLM's extra sampling fields, and their ``SamplingParams``.

Bodies are validated strictly: a field of the wrong type, or one the API does
not have, is refused naming it (``RequestError``, HTTP 400), rather than
coerced or ignored. ``to_sampling_params`` maps the fields with vLLM's
semantics; a value ``SamplingParams`` refuses is reported under the request's
own field name.
"""

from __future__ import annotations

import re
from typing import Any, Literal, cast

import pydantic

from jaxrunner.engine.structured_outputs import StructuredOutputsParams
from jaxrunner.interfaces import SamplingParams


class RequestError(ValueError):
    """A request the server refuses, OpenAI's error object's fields with it: ``param`` names the field,
    ``status`` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, error_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type


class _Strict(pydantic.BaseModel):
    """Unknown fields refused, values not coerced (``"2"`` is no integer)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = pydantic.Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """The fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    return_token_ids: bool = False
    """vLLM's: each choice carries its ``token_ids``, the response its ``prompt_token_ids``."""

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk of token counts (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts, one engine request each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [cast(list[int], prompt)]
        return cast(list[str] | list[list[int]], prompt)

    def to_sampling_params(self) -> SamplingParams:
        return _sampling_params(self, self.max_tokens, self.logprobs, {"logprobs": "logprobs"})


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: a conversation, rendered by the tokenizer's chat template."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens_field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return _sampling_params(
            self, max_tokens, logprobs, {"logprobs": "top_logprobs", "max_tokens": max_tokens_field}
        )


def _sampling_params(
    request: _SamplingRequest, max_tokens: int | None, logprobs: int | None, renamed: dict[str, str]
) -> SamplingParams:
    """The request's ``SamplingParams`` (vLLM's mapping); ``RequestError`` naming the request's field
    (``renamed``: SamplingParams' name -> the request's where they differ) for a value it refuses."""
    try:
        return SamplingParams(
            n=request.n,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            logit_bias=_logit_bias(request.logit_bias),
            structured_outputs=_structured_outputs(request),
        )
    except RequestError:
        raise
    except ValueError as error:
        raise engine_error(str(error), None, renamed) from None


def engine_error(message: str, default_param: str | None, renamed: dict[str, str] | None = None) -> RequestError:
    """A ``SamplingParams`` or engine refusal in the request's terms: the field it names
    (``SamplingParams.top_p`` -> ``top_p``, ``renamed`` where the request's name differs), else
    ``default_param``."""
    renamed = renamed or {}
    found = re.search(r"SamplingParams\.(\w+)", message)
    param = renamed.get(found.group(1), found.group(1)) if found else default_param
    message = re.sub(r"SamplingParams\.(\w+)", lambda m: renamed.get(m.group(1), m.group(1)), message)
    return RequestError(message, param)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit bias keys are token ids as strings."""
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise RequestError("logit_bias keys must be token ids (integers as strings).", "logit_bias") from None


def _structured_outputs(request: _SamplingRequest) -> StructuredOutputsParams | None:
    """``response_format`` (OpenAI's) or ``structured_outputs`` (vLLM's) as the engine's constraint."""
    if request.structured_outputs is not None:
        if request.response_format is not None:
            raise RequestError("Give response_format or structured_outputs, not both.", "structured_outputs")
        try:
            return StructuredOutputsParams(**request.structured_outputs)
        except (TypeError, ValueError) as error:
            raise RequestError(f"structured_outputs: {error}", "structured_outputs") from None
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json={"type": "object"})
    if response_format.json_schema is None:
        raise RequestError('response_format of type "json_schema" needs its json_schema.', "response_format")
    try:
        return StructuredOutputsParams(json=response_format.json_schema.json_schema)
    except ValueError as error:
        raise RequestError(f"response_format: {error}", "response_format") from None


def validation_error(error: pydantic.ValidationError) -> RequestError:
    """A body that does not fit the request's model, as a ``RequestError`` naming its first bad field."""
    first = error.errors()[0]
    location = [str(part) for part in first["loc"]]
    # A union's failure names the union member that was tried; the field is what precedes it.
    param = ".".join(p for p in location if not re.match(r"^(str|int|list|dict|float|bool|none)\b", p)) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return RequestError(message, param)
