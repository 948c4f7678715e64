"""Layers more than one model family shares: HF's rotate-half RoPE, the RMSNorm and the MLP activations."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike
from jaxtyping import Array, Float


def apply_rope(
    x: Float[Array, "num_tokens heads head_dim"],
    cos: Float[Array, "num_tokens half_head_dim"],
    sin: Float[Array, "num_tokens half_head_dim"],
) -> Float[Array, "num_tokens heads head_dim"]:
    """Rotates pairs ``(x[i], x[i + head_dim / 2])`` (HF's rotate-half layout), in float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}
"""The gated MLPs' activations, by HF ``hidden_act`` (``hidden_activation``) name."""


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, statistics and scale in float32.

    The scale is ``offset + weight``: 0 for Llama's norms, 1 for Gemma's (whose
    weights are stored around 0).
    """

    def __init__(self, dim: int, eps: float, *, dtype: DTypeLike, param_dtype: DTypeLike, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, param_dtype))
        self.eps = eps
        self.dtype = dtype
        self.offset = offset

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(self.dtype)
