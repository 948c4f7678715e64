"""What a ``SchedulerOutput`` may ask of the runner that it cannot do yet, refused before any state changes.

vLLM's runner takes LoRA adapters, multimodal inputs and several KV-cache groups
through the same ``SchedulerOutput``; while LoRA is off, for images on a text model,
and for block ids of more KV-cache groups than the model keeps, a request carrying
one fails with a message naming what is missing, instead of running as if the field
were absent.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxrunner.interfaces import SchedulerOutput
from jaxrunner.runner.lora import LORA_OFF


def refuse_combinations(subject: str, features: Iterable[tuple[str, bool]], remedy: str) -> None:
    """Raise ``NotImplementedError`` saying that ``subject`` cannot be served with the first of ``features``
    (name, whether in use) that is in use, and ``remedy``; checked at start, before anything is built."""
    for feature, used in features:
        if used:
            raise NotImplementedError(f"{subject} cannot be served with {feature} yet; {remedy}")


def refuse_unsupported(
    scheduler_output: SchedulerOutput, lora_enabled: bool, multimodal: bool = False, num_kv_cache_groups: int = 1
) -> None:
    """Raise ``NotImplementedError`` naming the first request that needs a feature the runner lacks
    (LoRA adapters where ``lora_enabled`` is False, images unless the model is ``multimodal``, block ids
    of other than the model's ``num_kv_cache_groups``)."""
    for new_req in scheduler_output.scheduled_new_reqs:
        if new_req.lora_request is not None and not lora_enabled:
            raise NotImplementedError(f"Request {new_req.req_id!r} has a lora_request, but {LORA_OFF}")
        if new_req.mm_features and not multimodal:
            raise NotImplementedError(
                f"Request {new_req.req_id!r} has multimodal inputs (mm_features), but the model is a text "
                "model with no encoder. Send text or token ids only, or serve a vision-language model."
            )
        if len(new_req.block_ids) > num_kv_cache_groups:
            raise NotImplementedError(
                f"Request {new_req.req_id!r} has block ids for {len(new_req.block_ids)} KV-cache groups: "
                f"the model keeps {num_kv_cache_groups}."
            )
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
        if new_block_ids is not None and len(new_block_ids) > num_kv_cache_groups:
            raise NotImplementedError(
                f"Request {req_id!r} has new block ids for {len(new_block_ids)} KV-cache groups: "
                f"the model keeps {num_kv_cache_groups}."
            )
    if scheduler_output.scheduled_encoder_inputs and not multimodal:
        raise NotImplementedError(
            "The step schedules encoder inputs (scheduled_encoder_inputs), but the model is a text model with no "
            "encoder."
        )
