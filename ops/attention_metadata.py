"""The per-step attention metadata shared by the model, the KV write and attention."""

import dataclasses

import jax
from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each packed query token sits in the paged KV cache.

    Requests are packed back to back along the token axis. Request ``r`` owns
    query tokens ``query_start_loc[r]:query_start_loc[r + 1]``; they are the last
    ``query_len`` tokens of its ``seq_lens[r]`` tokens, so the token at packed
    index ``t`` has position ``seq_lens[r] - (query_start_loc[r + 1] - t)``.
    Padded requests have ``seq_len`` 0 and ``query_start_loc`` repeating the
    number of real tokens; padded tokens (past ``query_start_loc[-1]``) have
    slot -1: they are never written and attend to nothing.
    """

    query_start_loc: Int[Array, " num_reqs_plus_1"]
    seq_lens: Int[Array, " num_reqs"]
    block_tables: Int[Array, "num_reqs max_blocks_per_req"]
    slot_mapping: Int[Array, " num_tokens"]
