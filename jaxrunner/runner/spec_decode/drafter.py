"""What the step programs ask of a proposer that drafts on the device, and the parts drafters share.

A drafter runs inside the compiled programs: in the forward program it fills
its own KV cache from this step's tokens (``on_step``); in the sampling program,
after verification, it proposes the next step's drafts (``propose``) and leaves
them on the device. The programs hand it its module, merged from its graph and
parameters with the device state's KV cache scales, and read the scales back
after the call (``calculate_kv_scales`` sets them at the first write).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.models import CausalLM
from jaxrunner.models.eagle import EagleHead
from jaxrunner.ops import AttentionBackend, AttentionMetadata
from jaxrunner.runner.block_table import compute_slot_mapping
from jaxrunner.runner.kv_cache import KVCaches, KVCacheSpec


@runtime_checkable
class Drafter(Protocol):
    """A proposer on the device: a draft model or an EAGLE head, split for jit."""

    graphdef: nnx.GraphDef
    params: nnx.State
    kv_spec: KVCacheSpec  # its KV cache, on the target's block ids

    def on_step(
        self,
        module: Any,  # the drafter's own: a DraftModel's CausalLM, an EagleDrafter's EagleHead
        kv_caches: KVCaches,
        target: CausalLM,
        input_ids: Int[Array, " num_tokens"],
        positions: Int[Array, " num_tokens"],
        metadata: AttentionMetadata,
        hidden: Float[Array, "num_tokens hidden_size"],
        attention_backend: AttentionBackend,
    ) -> KVCaches:
        """The drafter's KV cache after this step's tokens (``hidden``: the target's features at them)."""
        ...

    def propose(
        self,
        module: Any,  # the drafter's own: a DraftModel's CausalLM, an EagleDrafter's EagleHead
        kv_caches: KVCaches,
        target: CausalLM,
        block_table: Int[Array, "max_reqs max_blocks_per_req"],
        slots: Int[Array, " num_rows"],
        last_tokens: Int[Array, " num_rows"],
        positions: Int[Array, " num_rows"],
        features: Float[Array, "num_rows hidden_size"],
        active: Bool[Array, " num_rows"],
        num_drafts: int,
        block_size: int,
        attention_backend: AttentionBackend,
    ) -> tuple[KVCaches, Int[Array, "num_rows num_spec"]]:
        """Greedy drafts, ``num_drafts`` per active row, from its last token at ``positions``."""
        ...


@dataclasses.dataclass
class DeviceDrafter:
    """A proposer module split for jit: its graph, its parameters and its KV cache's spec."""

    graphdef: nnx.GraphDef
    params: nnx.State
    kv_spec: KVCacheSpec

    @classmethod
    def split(cls, module: CausalLM | EagleHead, block_size: int, kv_dtype):
        """A drafter of ``module``: its graph, its parameters and its KV cache's spec (``block_size``, ``kv_dtype``)."""
        config = module.config
        graphdef, params = nnx.split(module)
        spec = KVCacheSpec(config.num_layers, block_size, config.num_kv_heads, config.head_dim, kv_dtype)
        return cls(graphdef, params, spec)


DraftStep = Callable[
    [
        Int[Array, " num_rows"],
        Float[Array, "num_rows hidden_size"],
        AttentionMetadata,
        Int[Array, " num_rows"],
        KVCaches,
    ],
    tuple[Float[Array, "num_rows vocab_size"], Float[Array, "num_rows hidden_size"], KVCaches],
]
"""One pass of one token per row: (tokens, features, metadata, positions, caches) -> (logits, features, caches)."""


def decode_drafts(
    step: DraftStep,
    kv_caches: KVCaches,
    block_table: Int[Array, "max_reqs max_blocks_per_req"],
    slots: Int[Array, " num_rows"],
    last_tokens: Int[Array, " num_rows"],
    positions: Int[Array, " num_rows"],
    features: Float[Array, "num_rows hidden_size"],
    active: Bool[Array, " num_rows"],
    num_drafts: int,
    block_size: int,
) -> tuple[KVCaches, Int[Array, "num_rows num_spec"]]:
    """Run ``step`` (one token per row) ``num_drafts`` times, feeding back argmax tokens and features."""
    n = slots.shape[0]
    tables = block_table.at[slots].get(mode="fill", fill_value=0)
    drafts = []
    tokens, feats, pos = last_tokens, features, positions
    for _ in range(num_drafts):
        metadata = AttentionMetadata(
            query_start_loc=jnp.arange(n + 1, dtype=jnp.int32),
            seq_lens=jnp.where(active, pos + 1, 0),
            block_tables=tables,
            slot_mapping=compute_slot_mapping(block_table, slots, pos, active, block_size),
        )
        logits, feats, kv_caches = step(tokens, feats, metadata, jnp.where(active, pos, 0), kv_caches)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(tokens)
        pos = pos + 1
    return kv_caches, jnp.stack(drafts, axis=1)
