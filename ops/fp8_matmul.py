"""Matmuls with FP8 weights: ``x @ Wᵀ`` for a weight stored in float8_e4m3fn with a float32 scale per output.

A weight is kept as HF stores it, ``[*out, in]`` (the contraction axis minor, the
layout FP8 GEMMs read without a transpose), and ``weight_scale[*out]`` says what
each output's stored values are multiplied by: a per-tensor scale of the
checkpoint is the same value repeated over the outputs of its part, so merged
q/k/v and gate/up keep their parts' scales.

Two implementations of the same product (:data:`IMPLS`):

- ``"w8a8"``: ``x`` quantized to e4m3 too, per token from its own largest value
  (``activations="dynamic"``) or by the layer's calibrated ``input_scale``
  (``"static"``); one FP8 x FP8 dot accumulating in float32, then both scales.
  On Hopper, XLA's FP8 GEMM at twice the bf16 rate.
- ``"weight_only"``: ``x`` as it is, the weight converted to the compute dtype in
  the dot's operand: the same FP8 bytes read, no error from quantizing ``x``.

Which one a step runs is chosen per token bucket (:func:`fp8_matmul_impl`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

IMPLS = ("w8a8", "weight_only")
"""The FP8 matmul implementations (``$JAXRUNNER_FP8_MATMUL`` forces one)."""

ACTIVATION_SCHEMES = ("dynamic", "static")
"""How ``x`` is scaled under ``"w8a8"``: per token each step, or by the checkpoint's ``input_scale``."""

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""The smallest scale computed (vLLM's ``min_scaling_factor``): an all-zero row or weight divides by this."""

WEIGHT_ONLY_MAX_TOKENS = 64
"""Token buckets up to this size run ``"weight_only"``, larger ones ``"w8a8"``, where the checkpoint quantizes
activations: at 1 and 64 rows the weight-only product is the faster of the two on the 8B's projections (no
per-token quantization of the input), at 8192 rows W8A8's FP8 GEMM is (``benchmarks/decisions/fp8_weights.md``)."""


def quantize(
    x: Float[Array, "*batch n"], scale: Float[Array, "*batch 1"] | Float[Array, ""]
) -> Float[Array, "*batch n"]:
    """``x / scale`` saturated to e4m3's range and rounded to e4m3 (to nearest, ties to even)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def amax_scale(x: Float[Array, "*batch n"]) -> Float[Array, "*batch 1"]:
    """The scale that maps each row's largest magnitude onto e4m3's largest value (at least :data:`MIN_SCALE`)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return jnp.maximum(amax / FP8_MAX, MIN_SCALE)


def quantize_weight(
    w: Float[Array, "*out_shape in_features"],
) -> tuple[Float[Array, "*out_shape in_features"], Float[Array, " *out_shape"]]:
    """A weight quantized per output: its e4m3 values and float32 scales (``w ≈ values * scale[..., None]``)."""
    scale = amax_scale(w)
    return quantize(w, scale), scale[..., 0]


def fp8_matmul_impl(num_tokens: int, activations: str | None, forced: str | None = None) -> str:
    """The implementation a bucket of ``num_tokens`` runs: ``forced`` if given; ``"weight_only"`` where the
    checkpoint quantizes weights only (``activations`` None) or the bucket is at most
    :data:`WEIGHT_ONLY_MAX_TOKENS`; else ``"w8a8"``."""
    if forced is not None:
        return forced
    if activations is None or num_tokens <= WEIGHT_ONLY_MAX_TOKENS:
        return "weight_only"
    return "w8a8"


def fp8_matmul(
    x: Float[Array, "num_tokens in_features"],
    weight: Float[Array, "*out_shape in_features"],
    weight_scale: Float[Array, " *out_shape"],
    input_scale: Float[Array, ""] | None,
    *,
    impl: str,
    dtype,
) -> Float[Array, " num_tokens *out_shape"]:
    """``x @ (weight * weight_scale)ᵀ`` in ``dtype``, by ``impl`` (one of :data:`IMPLS`); ``"w8a8"`` scales
    ``x`` by ``input_scale`` where given, else per token."""
    contract = (((1,), (weight.ndim - 1,)), ((), ()))
    if impl == "weight_only":
        y = jax.lax.dot_general(x.astype(dtype), weight.astype(dtype), contract, preferred_element_type=jnp.float32)
        return (y * weight_scale).astype(dtype)
    if impl != "w8a8":
        raise ValueError(f"unknown FP8 matmul impl {impl!r}; valid: {', '.join(map(repr, IMPLS))}")
    x_scale = amax_scale(x) if input_scale is None else input_scale
    y = jax.lax.dot_general(quantize(x, x_scale), weight, contract, preferred_element_type=jnp.float32)
    x_scale = jnp.reshape(x_scale, (-1,) + (1,) * (weight.ndim - 1)) if input_scale is None else x_scale
    return (y * x_scale * weight_scale).astype(dtype)
