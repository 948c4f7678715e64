"""M-RoPE positions of the runner's requests (vLLM's ``MRopeState``), for Qwen2-VL-style models.

A request's prefill tokens take three position rows from its images' grids
(``jaxrunner.models.mrope``), computed once on the host when it joins and written
with its new-request row into ``DeviceState.mrope_positions``; every later token
(decode, or prefill past the prompt) is at ``position + delta`` in all three
rows. ``build_step_inputs`` reads them on the device, so decode steps need
nothing from the host.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxrunner.interfaces import NewRequestData
from jaxrunner.models.mrope import VisionSpan, span_positions


def prefill_mrope_positions(
    new_req: NewRequestData, spatial_merge_size: int
) -> tuple[Int[np.ndarray, "3 prefill_len"], int]:
    """The request's prefill positions (its prompt's, then ``position + delta`` for outputs it resumes
    with) and its ``delta``."""
    assert new_req.prefill_token_ids is not None
    spans = [VisionSpan(f.mm_position.offset, f.mm_position.length, f.data.grid_thw) for f in new_req.mm_features]
    num_prompt = len(new_req.prompt_token_ids)
    positions, delta = span_positions(num_prompt, spans, spatial_merge_size)
    resumed = np.arange(num_prompt, len(new_req.prefill_token_ids)) + delta
    return np.concatenate([positions, np.broadcast_to(resumed, (3, resumed.size))], axis=1), delta


def mrope_positions(
    table: Int[Array, "max_reqs 3 max_model_len"],
    delta: Int[Array, " max_reqs"],
    prefill_len: Int[Array, " num_tokens"],
    token_slot: Int[Array, " num_tokens"],
    positions: Int[Array, " num_tokens"],
) -> Int[Array, "3 num_tokens"]:
    """Each token's three position rows: its request's precomputed prefill row, or ``position + delta``."""
    prefill = table.at[token_slot, :, positions].get(mode="fill", fill_value=0).T
    later = positions + delta.at[token_slot].get(mode="fill", fill_value=0)
    return jnp.where((positions < prefill_len)[None, :], prefill, later[None, :])
