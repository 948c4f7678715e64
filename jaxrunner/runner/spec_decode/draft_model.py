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

from jaxtyping import Array, Bool, Float, Int

from jaxrunner.models import CausalLM
from jaxrunner.ops import AttentionBackend, AttentionMetadata
from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.spec_decode.drafter import DeviceDrafter, decode_drafts


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
        self,
        module: CausalLM,
        kv_caches: KVCaches,
        target: CausalLM,
        input_ids: Int[Array, " num_tokens"],
        positions: Int[Array, " num_tokens"],
        metadata: AttentionMetadata,
        hidden: Float[Array, "num_tokens hidden_size"],
        attention_backend: AttentionBackend,
    ) -> KVCaches:
        """The draft's KV for this step's tokens (its outputs are not needed)."""
        _, kv_caches = module(input_ids, positions, kv_caches, metadata, attention_backend)
        return kv_caches

    def propose(
        self,
        module: CausalLM,
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
        """Greedy drafts: ``num_drafts`` one-token passes from each active row's last token.

        ``positions`` is the position of ``last_tokens``; ``features`` (the
        target's hidden state there) is for heads that read it. Inactive rows
        write nothing and attend to nothing.
        """

        def step(tokens, feats, metadata, pos, caches):
            hidden, caches = module(tokens, pos, caches, metadata, attention_backend)
            return module.compute_logits(hidden), hidden, caches

        return decode_drafts(
            step, kv_caches, block_table, slots, last_tokens, positions, features, active, num_drafts, block_size
        )
