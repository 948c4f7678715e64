"""A runner brought back after a step was cut short (an exception, KeyboardInterrupt included).

The runner donates its KV caches and its device state to each program it calls
and keeps the arrays the program returns. A call cut short after the program
took its inputs and before the runner stored its outputs leaves the runner
holding deleted buffers, which every later step would pass to a program
("Buffer has been deleted or donated"). Its request bookkeeping may be half
updated too. ``reset_runner`` drops every request, re-creates the KV caches
(the target's and a drafter's) that were lost and starts the device state
afresh (no slot keeps the drafts or the counts of the step cut short),
keeping the KV cache scales computed so far. The LoRA slots' weights are
never donated, so they survive: as every request leaves, every slot becomes
unused and keeps its adapter. The engine, which aborted every request,
forgets the KV cache's contents (its prefix cache) along with them, and the
encoder cache's (re-created if it was lost).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxrunner.runner.kv_cache import allocate_kv_caches
from jaxrunner.runner.model_runner import ModelRunner


def reset_runner(runner: ModelRunner) -> None:
    """Drop every request the runner holds, the step it dispatched included, re-create the KV caches
    a program call took and never gave back, and start the device state afresh."""
    runner.execute_model_state = None
    for req_id in list(runner.req_states.req_id_to_index):
        for feature in runner.request_features:
            feature.remove_request(req_id)
    runner.req_states.reset()
    runner.block_tables.reset()
    if runner.encoder_runner is not None:
        runner.encoder_runner.reset(lost=_lost(runner.encoder_runner.cache))
    if _lost(runner.kv_caches):
        runner.kv_caches = allocate_kv_caches(runner.kv_cache_spec, runner.num_blocks, runner.kv_cache_sharding)
    if runner.drafter is not None and _lost(runner.draft_kv_caches):
        runner.draft_kv_caches = allocate_kv_caches(runner.drafter.kv_spec, runner.num_blocks, runner.kv_cache_sharding)
    state = runner.fresh_device_state()
    scales = (runner.device_state.kv_scales, runner.device_state.draft_kv_scales)
    if not _lost(scales):  # computed ones (calculate_kv_scales) are kept: vLLM computes them once
        state = dataclasses.replace(state, kv_scales=scales[0], draft_kv_scales=scales[1])
    runner.device_state = state


def _lost(tree: object) -> bool:
    """Whether any array of ``tree`` was deleted (donated to a program whose outputs were lost)."""
    return any(leaf.is_deleted() for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))
