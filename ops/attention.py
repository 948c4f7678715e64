"""The public ragged paged attention entry: one signature, several implementations."""

from jaxtyping import Array, Float

from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.attention_reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("reference",)
"""Valid ``impl`` values; None picks the best one for the backend."""


def ragged_paged_attention(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    v_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str | None = None,
) -> Float[Array, "num_tokens num_q_heads head_dim"]:
    """Causal attention of a packed mixed batch over the paged KV cache.

    See :func:`ragged_paged_attention_reference` for the semantics every
    implementation shares. ``impl`` forces one of :data:`IMPLEMENTATIONS`; None picks
    for the backend (for now always the pure-JAX reference).
    """
    if impl not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"unknown attention impl {impl!r}; valid: None, {', '.join(map(repr, IMPLEMENTATIONS))}")
    return ragged_paged_attention_reference(
        q, k_cache, v_cache, metadata, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
