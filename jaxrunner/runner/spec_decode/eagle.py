"""EAGLE proposer: a draft head fed by the target's hidden states.

In the forward program the head consumes, at every scheduled position, the
target's feature there and the token that follows it (the last token of each
request has no successor yet and is skipped). In the sampling program, after
verification, it starts from the target's feature at the last accepted
position and the newly sampled token, and feeds its own predicted features
back for ``k`` greedy drafts. It shares the target's embedding and lm_head.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.models import CausalLM
from jaxrunner.models.eagle import EagleHead
from jaxrunner.ops import AttentionBackend, AttentionMetadata
from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.spec_decode.drafter import DeviceDrafter, decode_drafts


class EagleDrafter(DeviceDrafter):
    """An EAGLE head; it reads the target's embedding, features and lm_head."""

    @classmethod
    def from_head(cls, head: EagleHead, block_size: int, kv_dtype, target_hidden: int) -> EagleDrafter:
        """A drafter around a built EAGLE head; its feature width must be the target's hidden size."""
        if head.config.hidden_size != target_hidden:
            raise ValueError(
                f"The EAGLE head's hidden size ({head.config.hidden_size}) differs from the target's "
                f"({target_hidden}); it must read the target's features."
            )
        return cls.split(head, block_size, kv_dtype)

    def on_step(
        self,
        module: EagleHead,
        kv_caches: KVCaches,
        target: CausalLM,
        input_ids: Int[Array, " num_tokens"],
        positions: Int[Array, " num_tokens"],
        metadata: AttentionMetadata,
        hidden: Float[Array, "num_tokens hidden_size"],
        attention_backend: AttentionBackend,
    ) -> KVCaches:
        """The head's KV at every position whose next token is known this step."""
        next_ids = jnp.concatenate([input_ids[1:], jnp.zeros(1, input_ids.dtype)])
        last = jnp.zeros(input_ids.shape[0], bool).at[metadata.query_start_loc[1:] - 1].set(True, mode="drop")
        skip_last = AttentionMetadata(
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            jnp.where(last, -1, metadata.slot_mapping),
        )
        _, kv_caches = module(target.embed(next_ids), hidden, positions, kv_caches, skip_last, attention_backend)
        return kv_caches

    def propose(
        self,
        module: EagleHead,
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
        """Greedy drafts from each row's last token (at ``positions``) and the feature before it."""

        def step(tokens, feats, metadata, pos, caches):
            embedded = target.embed(tokens)
            predicted, caches = module(embedded, feats, pos, caches, metadata, attention_backend)
            return target.compute_logits(predicted), predicted, caches

        # The pair (feature at p, token at p + 1) sits at position p, as in on_step.
        return decode_drafts(
            step, kv_caches, block_table, slots, last_tokens, positions - 1, features, active, num_drafts, block_size
        )
