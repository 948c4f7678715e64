"""The prompt forms ``LLM`` takes, with vLLM's names (``vllm.inputs``; public as ``jaxrunner.inputs``).

A prompt is text, token ids, or a dict naming either: ``TextPrompt``
(``{"prompt": text}``) or ``TokensPrompt`` (``{"prompt_token_ids": ids}``, with
an optional ``"prompt"``: the text the ids stand for, shown in the output).
Either dict may carry ``multi_modal_data`` (``{"image": image_or_list}``) for a
vision-language model; the engine reads and checks the images, per prompt.
Token ids may be Python or NumPy integers, or a one-dimensional NumPy integer
array; they become Python ints. Anything else is refused here, before any
prompt of a call reaches the engine, with an error naming the prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict

import numpy as np


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine, with its images if any."""

    prompt: str
    multi_modal_data: NotRequired[Mapping[str, object]]


class TokensPrompt(TypedDict):
    """A prompt given as token ids; ``prompt``, if given, is the text they stand for (shown in the output)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Mapping[str, object]]


PromptType = str | TextPrompt | TokensPrompt | Sequence[int | np.integer] | np.ndarray
"""One prompt, in any of the forms ``LLM`` takes."""

_DICT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


@dataclasses.dataclass(frozen=True)
class ParsedPrompt:
    """One prompt in the engine's terms: its text (None for bare token ids), its token ids (None: tokenize the
    text), and its images (``multi_modal_data``, None: none)."""

    text: str | None
    token_ids: list[int] | None
    multi_modal_data: Mapping[str, object] | None = None


def is_token_id(value: object) -> bool:
    """Whether ``value`` is a Python or NumPy integer (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_prompt_list(prompts: object) -> list[object]:
    """``prompts`` as a list of prompts: one prompt (text, a dict, token ids) becomes a list of one;
    a two-dimensional integer array, one prompt per row."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        return list(prompts) if prompts.ndim == 2 else [prompts]
    if isinstance(prompts, Sequence):
        return [prompts] if prompts and is_token_id(prompts[0]) else list(prompts)
    raise TypeError(
        f"prompts must be a prompt (text, token ids, a TextPrompt or TokensPrompt dict) or a sequence of "
        f"prompts; got {type(prompts).__name__}."
    )


def parse_prompt(prompt: object, where: str = "prompt") -> ParsedPrompt:
    """``prompt`` in the engine's terms; TypeError or ValueError naming ``where`` (e.g. ``prompts[2]``)
    if it is none of the forms a prompt takes."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt, where)
    if isinstance(prompt, (np.ndarray, Sequence)):
        return ParsedPrompt(None, _token_ids(prompt, where))
    raise TypeError(
        f"{where} must be text, token ids or a dict (TextPrompt / TokensPrompt); got {type(prompt).__name__}."
    )


def _parse_dict(prompt: Mapping, where: str) -> ParsedPrompt:
    unknown = sorted(str(k) for k in prompt if k not in _DICT_KEYS)
    if unknown:
        raise ValueError(
            f"{where} has keys {unknown} that are not supported: a prompt dict takes 'prompt' (a TextPrompt) "
            "or 'prompt_token_ids' with an optional 'prompt' (a TokensPrompt), and optionally 'multi_modal_data'."
        )
    mm_data = prompt.get("multi_modal_data")
    if mm_data is not None and not isinstance(mm_data, Mapping):
        raise TypeError(
            f"{where}['multi_modal_data'] must be a dict by modality ({{'image': image_or_list}}); "
            f"got {type(mm_data).__name__}."
        )
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{where}['prompt'] must be text (a str); got {type(text).__name__}.")
    if "prompt_token_ids" in prompt:
        return ParsedPrompt(text, _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']"), mm_data)
    if text is None:
        raise ValueError(f"{where} is a dict without 'prompt' or 'prompt_token_ids'; give one of them.")
    return ParsedPrompt(text, None, mm_data)


def _token_ids(ids: object, where: str) -> list[int]:
    """``ids`` as Python ints; TypeError naming ``where`` unless they are integers in a sequence or a 1-D array."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(
                f"{where} is a NumPy array of {ids.dtype} with shape {ids.shape}; token ids must be a "
                "one-dimensional integer array (convert it with .astype(int) if its values are whole numbers)."
            )
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{where} must be token ids (a sequence of integers); got {type(ids).__name__}.")
    for position, token in enumerate(ids):
        if not is_token_id(token):
            raise TypeError(f"{where}[{position}] is {token!r} ({type(token).__name__}); token ids must be integers.")
    return [int(t) for t in ids]
