"""Chat messages in OpenAI's form, made ready for a tokenizer's chat template (vLLM's chat parsing).

A message's content is text or a list of parts. Text parts pass through; image
parts (``image_url`` with a local path, ``file://`` or ``data:`` URL, or
``image_pil`` with a PIL image) become the template's ``{"type": "image"}``
parts, their images collected in order for the prompt's ``multi_modal_data``.
A conversation without images keeps each message's text parts joined by
newlines, as text-only templates expect a string.
"""

from __future__ import annotations

from collections.abc import Mapping

_IMAGE_PARTS = ("image_url", "image_pil")


def chat_messages(conversation: list[dict], where: str) -> tuple[list[dict], list[object]]:
    """The conversation as the chat template takes it, and its images in order; ValueError naming
    ``where`` for a part of unknown form."""
    images: list[object] = []
    rendered = []
    for m, message in enumerate(conversation):
        content = message.get("content")
        if isinstance(content, str) or content is None:
            rendered.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _IMAGE_PARTS:
                images.append(_image_of(part, kind))
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"{where}, message {m}, part {p}: {part!r} is not a content part this engine takes "
                    "({'type': 'text', 'text': ...}, {'type': 'image_url', 'image_url': {'url': ...}} or "
                    "{'type': 'image_pil', 'image_pil': image})."
                )
        rendered.append({**message, "content": parts})
    if not images:  # text-only templates take a string
        for message in rendered:
            if isinstance(message.get("content"), list):
                message["content"] = "\n".join(part["text"] for part in message["content"])
    return rendered, images


def _image_of(part: Mapping, kind: str) -> object:
    """The image a part names: a PIL image, or a URL or path the processor reads."""
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    return value
