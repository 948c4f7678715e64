"""The public ragged paged attention entry: one signature, several implementations."""

import os

import jax
from jaxtyping import Array, Float

from jaxrunner.compat import is_hopper, mosaic_gpu_interpreter_off_gpu
from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.attention_mgpu import kernel_supports, ragged_paged_attention_mgpu
from jaxrunner.ops.attention_reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("reference", "mosaic_gpu")
"""Valid ``impl`` values; None picks the best one for the backend."""

IMPL_ENV_VAR = "JAXRUNNER_ATTENTION_IMPL"
"""Environment flag forcing an implementation for every call that passes no ``impl``."""


def forced_impl(impl: str | None) -> str | None:
    """The implementation forced by ``impl`` or ``$JAXRUNNER_ATTENTION_IMPL``, checked; None when neither is set."""
    impl = impl or os.environ.get(IMPL_ENV_VAR) or None
    if impl not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"unknown attention impl {impl!r} (argument or ${IMPL_ENV_VAR}); "
            f"valid: None, {', '.join(map(repr, IMPLEMENTATIONS))}"
        )
    return impl


def pick_impl(q: Array, k_cache: Array, impl: str | None) -> str:
    """The forced implementation, else the Mosaic GPU kernel on Hopper where it applies, else the reference."""
    impl = forced_impl(impl)
    if impl is None:
        fits = kernel_supports(q.dtype, q.shape[-1], k_cache.shape[1])
        impl = "mosaic_gpu" if fits and is_hopper(jax.devices()[0]) else "reference"
    return impl


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
    implementation shares. ``impl`` (or ``$JAXRUNNER_ATTENTION_IMPL``) forces one of
    :data:`IMPLEMENTATIONS`; "mosaic_gpu" off a GPU runs the kernel through the
    Mosaic GPU interpreter (slow: for tests). None picks the kernel on Hopper for
    bf16/fp16 caches it supports, and the pure-JAX reference otherwise.
    """
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if pick_impl(q, k_cache, impl) == "reference":
        return ragged_paged_attention_reference(q, k_cache, v_cache, metadata, **kwargs)
    return ragged_paged_attention_mgpu(
        q, k_cache, v_cache, metadata, interpret=mosaic_gpu_interpreter_off_gpu(), **kwargs
    )
