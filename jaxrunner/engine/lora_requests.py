"""The LoRA adapters requests name, each checked once when its first request is added.

A request's adapter is refused, for that request alone, with a ``ValueError``
naming it: LoRA off, an adapter that cannot be read or does not fit the base
model (the runner reads it into its host LRU, where the request then finds it:
one read), or an id or name already given to another adapter (requests of one
``lora_int_id`` share its device slot, requests of one ``lora_name`` their
prefix-cache blocks, so each must name one adapter).
"""

from __future__ import annotations

from jaxrunner.lora.request import LoRARequest
from jaxrunner.runner.model_runner import ModelRunner


class LoRARequestChecker:
    """Checks each request's ``LoRARequest``; an adapter read once is not read again."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._checked: dict[int, LoRARequest] = {}  # by lora_int_id
        self._ids_by_name: dict[str, int] = {}

    def check(self, lora_request: object) -> None:
        """``ValueError`` naming the adapter if the request cannot run with it."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                "lora_request must be a LoRARequest (jaxrunner.lora.request) or None; "
                f"got {type(lora_request).__name__}."
            )
        name, lora_id, path = lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path
        if self.runner.config.lora_config is None:
            raise ValueError(f"LoRA adapter {name!r}: LoRA is off in this engine; make it with enable_lora=True.")
        known = self._checked.get(lora_id)
        if known == lora_request:
            return
        if known is not None:
            raise ValueError(
                f"LoRA adapter {name!r} at {path} (lora_int_id {lora_id}): lora_int_id {lora_id} already names "
                f"adapter {known.lora_name!r} at {known.lora_path}; give each adapter its own lora_int_id."
            )
        if name in self._ids_by_name:
            raise ValueError(
                f"LoRA adapter {name!r} at {path} (lora_int_id {lora_id}): the name {name!r} already names "
                f"lora_int_id {self._ids_by_name[name]}, and prefix caching shares KV blocks by name; give each "
                "adapter its own lora_name."
            )
        self.runner.check_lora_request(lora_request)
        self._checked[lora_id] = lora_request
        self._ids_by_name[name] = lora_id
