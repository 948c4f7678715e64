"""What a ``SchedulerOutput`` may ask of the runner that it cannot do yet, refused before any state changes.

vLLM's runner takes LoRA adapters, multimodal inputs and several KV-cache groups
through the same ``SchedulerOutput``; until this runner builds them (or, for LoRA,
while LoRA is off, and for images, on a text model), a request carrying one fails
with a message naming what is missing, instead of running as if the field were absent.
"""

from __future__ import annotations

from jaxrunner.interfaces import SchedulerOutput
from jaxrunner.runner.lora import LORA_OFF


def refuse_unsupported(scheduler_output: SchedulerOutput, lora_enabled: bool, multimodal: bool = False) -> None:
    """Raise ``NotImplementedError`` naming the first request that needs a feature the runner lacks
    (LoRA adapters where ``lora_enabled`` is False, images unless the model is ``multimodal``)."""
    for new_req in scheduler_output.scheduled_new_reqs:
        if new_req.lora_request is not None and not lora_enabled:
            raise NotImplementedError(f"Request {new_req.req_id!r} has a lora_request, but {LORA_OFF}")
        if new_req.mm_features and not multimodal:
            raise NotImplementedError(
                f"Request {new_req.req_id!r} has multimodal inputs (mm_features), but the model is a text "
                "model with no encoder. Send text or token ids only, or serve a vision-language model."
            )
        if len(new_req.block_ids) > 1:
            raise NotImplementedError(
                f"Request {new_req.req_id!r} has block ids for {len(new_req.block_ids)} KV-cache groups: "
                "only one KV-cache group is supported yet."
            )
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
        if new_block_ids is not None and len(new_block_ids) > 1:
            raise NotImplementedError(
                f"Request {req_id!r} has new block ids for {len(new_block_ids)} KV-cache groups: "
                "only one KV-cache group is supported yet."
            )
    if scheduler_output.scheduled_encoder_inputs and not multimodal:
        raise NotImplementedError(
            "The step schedules encoder inputs (scheduled_encoder_inputs), but the model is a text model with no "
            "encoder."
        )
