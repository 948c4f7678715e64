"""A draft model proposer: a smaller model of the same vocabulary, with its own KV cache.

Inside the forward program the draft model runs over the same packed tokens
as the target, so its cache holds every position the target computed (drafts
included: the accepted ones are then right). Inside the sampling program,
after verification, it decodes ``k`` tokens greedily from each request's new
last token, one token per request per pass, and leaves them on the device as
the next step's drafts. Its blocks are the target's block ids in its own
arrays, so the block table serves both.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.runner.block_table import compute_slot_mapping
from jaxrunner.runner.kv_cache import KVCaches, KVCacheSpec
from jaxrunner.models import CausalLM
from jaxrunner.ops import AttentionMetadata


@dataclasses.dataclass
class DeviceDrafter:
    """A proposer module split for jit: its graph, its parameters and its KV cache's spec."""

    graphdef: nnx.GraphDef
    params: nnx.State
    kv_spec: KVCacheSpec

    @classmethod
    def split(cls, module: nnx.Module, block_size: int, kv_dtype):
        """A drafter of ``module``: its graph, its parameters and the spec of its KV cache (``block_size``, ``kv_dtype``)."""
        config = module.config
        graphdef, params = nnx.split(module)
        spec = KVCacheSpec(config.num_layers, block_size, config.num_kv_heads, config.head_dim, kv_dtype)
        return cls(graphdef, params, spec)


class DraftModel(DeviceDrafter):
    """A smaller causal LM of the target's vocabulary."""

    @classmethod
    def from_model(cls, model: CausalLM, block_size: int, kv_dtype, target_vocab: int) -> DraftModel:
        """A drafter around a built draft model; its vocabulary must be the target's."""
        if model.config.vocab_size != target_vocab:
            raise ValueError(
                f"The draft model's vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({target_vocab}); a draft model must share the target's tokenizer."
            )
        return cls.split(model, block_size, kv_dtype)

    def on_step(
        self, params: nnx.State, kv_caches: KVCaches, target: CausalLM,
        input_ids: Int[Array, "T"], positions: Int[Array, "T"], metadata: AttentionMetadata,
        hidden: Float[Array, "T E"],
    ) -> KVCaches:
        """The draft's KV for this step's tokens (its outputs are not needed)."""
        _, kv_caches = nnx.merge(self.graphdef, params)(input_ids, positions, kv_caches, metadata)
        return kv_caches

    def propose(
        self, params: nnx.State, kv_caches: KVCaches, target: CausalLM,
        block_table: Int[Array, "R max_blocks"], slots: Int[Array, "n"], last_tokens: Int[Array, "n"],
        positions: Int[Array, "n"], features: Float[Array, "n E"], active: Bool[Array, "n"],
        num_drafts: int, block_size: int,
    ) -> tuple[KVCaches, Int[Array, "n k"]]:
        """Greedy drafts: ``num_drafts`` one-token passes from each active row's last token.

        ``positions`` is the position of ``last_tokens``; ``features`` (the
        target's hidden state there) is for heads that read it. Inactive rows
        write nothing and attend to nothing.
        """
        model = nnx.merge(self.graphdef, params)

        def step(tokens, feats, metadata, pos, caches):
            hidden, caches = model(tokens, pos, caches, metadata)
            return model.compute_logits(hidden), hidden, caches

        return decode_drafts(step, kv_caches, block_table, slots, last_tokens, positions, features, active,
                             num_drafts, block_size)


def decode_drafts(step, kv_caches, block_table, slots, last_tokens, positions, features, active,
                  num_drafts: int, block_size: int):
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
