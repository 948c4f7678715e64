"""Build the ``AttentionMetadata`` of a packed batch by hand, for model and op tests.

Each request gets its own shuffled (non-contiguous) blocks of a small paged
cache, so a test exercises the block-table indirection rather than an
identity layout.
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Int

from jaxrunner.ops import AttentionMetadata


def packed_metadata(
    seq_lens: list[int],
    query_lens: list[int] | None = None,
    *,
    block_size: int,
    num_blocks: int,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
    blocks_per_req: int | None = None,
    seed: int = 0,
) -> tuple[AttentionMetadata, Int[np.ndarray, " num_tokens"]]:
    """Metadata and positions for requests whose last ``query_lens`` of ``seq_lens`` tokens are scheduled.

    ``query_lens`` defaults to ``seq_lens`` (full prefills). ``num_tokens`` and
    ``num_reqs`` pad the token and request axes as a bucketed runner would:
    padded tokens get slot -1 and position 0, padded requests seq_len 0.
    Each request owns ``blocks_per_req`` blocks (default: just enough), drawn
    without replacement from a seeded permutation, so calls with the same seed
    and ``blocks_per_req`` give each request the same blocks: a later step can
    continue the cache an earlier one wrote.
    """
    query_lens = list(seq_lens) if query_lens is None else list(query_lens)
    num_real_tokens = sum(query_lens)
    num_tokens = num_real_tokens if num_tokens is None else num_tokens
    num_reqs = len(seq_lens) if num_reqs is None else num_reqs
    needed = [-(-s // block_size) for s in seq_lens]
    width = max(needed) if blocks_per_req is None else blocks_per_req
    owned = needed if blocks_per_req is None else [blocks_per_req] * len(seq_lens)
    if max(needed) > width or sum(owned) > num_blocks:
        raise ValueError(f"requests need {needed} blocks of {block_size}, got {width} each of {num_blocks}")
    free = iter(np.random.default_rng(seed).permutation(num_blocks))
    block_tables = np.zeros((num_reqs, width), np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    start = 0
    for r, (seq_len, query_len, n) in enumerate(zip(seq_lens, query_lens, owned, strict=True)):
        block_tables[r, :n] = [next(free) for _ in range(n)]
        pos = np.arange(seq_len - query_len, seq_len)
        positions[start : start + query_len] = pos
        slots[start : start + query_len] = block_tables[r, pos // block_size] * block_size + pos % block_size
        start += query_len
    query_start_loc = np.full(num_reqs + 1, num_real_tokens, np.int32)
    query_start_loc[: len(query_lens) + 1] = np.cumsum([0, *query_lens])
    padded_seq_lens = np.zeros(num_reqs, np.int32)
    padded_seq_lens[: len(seq_lens)] = seq_lens
    metadata = AttentionMetadata(
        query_start_loc=jnp.asarray(query_start_loc),
        seq_lens=jnp.asarray(padded_seq_lens),
        block_tables=jnp.asarray(block_tables),
        slot_mapping=jnp.asarray(slots),
    )
    return metadata, positions
