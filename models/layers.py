"""Layers more than one model family shares: HF's rotate-half RoPE and the RMSNorm."""

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


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, statistics in float32."""

    def __init__(self, dim: int, eps: float, *, dtype: DTypeLike, param_dtype: DTypeLike):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...].astype(jnp.float32)).astype(self.dtype)
