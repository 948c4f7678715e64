"""The public ragged paged attention entry: one signature, several implementations."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrunner.compat import mosaic_gpu_interpreter
from jaxrunner.ops.attention_backend import IMPLEMENTATIONS, AttentionBackend
from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.attention_mgpu import ragged_paged_attention_mgpu
from jaxrunner.ops.attention_reference import ragged_paged_attention_reference


def ragged_paged_attention(
    q: Float[Array, "num_tokens num_q_heads head_dim"],
    k_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    v_cache: Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    k_scale: Float[Array, ""] | None = None,
    v_scale: Float[Array, ""] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str | None = None,
    interpret: bool | None = None,
) -> Float[Array, "num_tokens num_q_heads head_dim"]:
    """Causal attention of a packed mixed batch over the paged KV cache.

    See :func:`ragged_paged_attention_reference` for the semantics every
    implementation shares. A scaled (FP8) cache holds ``k / k_scale`` and
    ``v / v_scale`` (float32 scalars; None: 1). Since ``q . (k_scale k') =
    (k_scale q) . k'`` and the output is linear in V, the scales are applied here,
    once for every implementation: the queries are multiplied by ``k_scale`` (in
    float32, then back to their dtype), the implementation reads the cache as it
    is stored (an FP8 value is exact in bf16), and its output is multiplied by
    ``v_scale`` in float32. ``impl`` is one of ``attention_backend.IMPLEMENTATIONS``;
    ``interpret`` runs the Mosaic GPU kernel through its interpreter. A runner
    passes both, from its ``AttentionBackend``. For a direct call, None resolves
    them from JAX's default devices and ``$JAXRUNNER_ATTENTION_IMPL``: the kernel on
    Hopper for the caches it supports, else the reference; interpreted off a GPU.
    """
    if impl is None or interpret is None:
        backend = AttentionBackend.default(impl)
        impl = backend.attention_impl(q, k_cache)
        interpret = backend.interpret if interpret is None else interpret
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; valid: {', '.join(map(repr, IMPLEMENTATIONS))}")
    if k_scale is not None:
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
    if impl == "reference":
        out = ragged_paged_attention_reference(
            q, k_cache, v_cache, metadata, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    else:
        out = ragged_paged_attention_mgpu(
            q,
            k_cache,
            v_cache,
            metadata,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=mosaic_gpu_interpreter() if interpret else None,
        )
    if v_scale is not None:
        out = (out.astype(jnp.float32) * v_scale).astype(out.dtype)
    return out
