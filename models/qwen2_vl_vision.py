"""Qwen2-VL's and Qwen2.5-VL's vision transformers in Flax NNX: image and video patches in, the language
model's embeddings out.

The processor (transformers' image processor, on the host) cuts an image into
``temporal_patch_size x patch_size x patch_size`` patches of every channel, flattened
in HF's order ``(channel, time, row, column)``, and orders them so that each
``spatial_merge_size x spatial_merge_size`` window of patches is contiguous. The
encoder embeds each patch (HF's Conv3d with stride equal to its kernel is one
matmul), runs ``depth`` pre-norm blocks of full attention within each frame (a
frame's patches attend to each other only) with a 2-D rotary embedding (half the
frequencies turn by the patch's row, half by its column), and merges each window
of ``spatial_merge_size**2`` patches into one token of the language model's width.
Qwen2.5-VL's tower differs in RMSNorms, a gated (SwiGLU) MLP, and attention within
windows of ``window_size`` pixels in every block but ``fullatt_block_indexes``.
HF permutes the patches so that each window is contiguous and permutes the merged
tokens back; attention with a window mask on the patches in place gives the same
tokens (every other step works token by token or on whole merge windows), so here
nothing is permuted. Parameter names follow HF's (``blocks[i].attn.qkv``,
``merger.mlp[0]``...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.models.layers import RMSNorm, apply_rope

NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape (HF's ``vision_config`` of a Qwen2-VL checkpoint)."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    out_hidden_size: int
    """The language model's width: what each merged token becomes."""
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    hidden_act: str = "quick_gelu"
    intermediate_size: int | None = None
    """The width of a gated (SwiGLU) MLP, as Qwen2.5-VL's; None: Qwen2-VL's ``fc1``/``fc2`` MLP of
    ``embed_dim x mlp_ratio``."""
    rms_norm: bool = False
    """RMSNorms (Qwen2.5-VL) instead of LayerNorms."""
    window_size: int | None = None
    """Attention within windows of this many pixels a side (Qwen2.5-VL), except in ``fullatt_block_indexes``."""
    fullatt_block_indexes: tuple[int, ...] = ()

    def __post_init__(self):
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported (one of {sorted(_ACTIVATIONS)})")

    @property
    def patch_features(self) -> int:
        """Values in one patch: channels x frames x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @classmethod
    def from_hf(cls, hf_vision_config: Any) -> VisionConfig:
        c = hf_vision_config
        shared = dict(
            depth=c.depth,
            num_heads=c.num_heads,
            in_channels=c.in_channels,
            patch_size=c.patch_size,
            temporal_patch_size=c.temporal_patch_size,
            spatial_merge_size=c.spatial_merge_size,
            rope_theta=c.rope_parameters["rope_theta"],
            hidden_act=c.hidden_act,
        )
        if c.model_type == "qwen2_5_vl_vision":  # its hidden_size is the tower's width, out_hidden_size the LM's
            return cls(
                **shared,
                embed_dim=c.hidden_size,
                mlp_ratio=0.0,
                out_hidden_size=c.out_hidden_size,
                intermediate_size=c.intermediate_size,
                rms_norm=True,
                window_size=c.window_size,
                fullatt_block_indexes=tuple(c.fullatt_block_indexes),
            )
        return cls(**shared, embed_dim=c.embed_dim, mlp_ratio=c.mlp_ratio, out_hidden_size=c.hidden_size)


_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
}


def patch_positions(grids: Sequence[Sequence[int]], spatial_merge_size: int) -> Int[np.ndarray, "num_patches 2"]:
    """Each patch's (row, column) in its frame, in the processor's order (merge windows contiguous,
    every frame of a video alike), for images and videos of grids ``(t, h, w)`` one after another."""
    rows = []
    m = spatial_merge_size
    for t, h, w in grids:
        grid = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), axis=-1)  # [h, w, 2]
        window_major = grid.reshape(h // m, m, w // m, m, 2).transpose(0, 2, 1, 3, 4).reshape(-1, 2)
        rows.append(np.tile(window_major, (t, 1)))
    return np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)


def frame_ids(grids: Sequence[Sequence[int]]) -> Int[np.ndarray, " num_patches"]:
    """Each patch's frame, numbered across all the images and videos: patches attend within a frame."""
    sizes = [h * w for t, h, w in grids for _ in range(t)]
    return np.repeat(np.arange(len(sizes)), sizes)


def window_ids(grids: Sequence[Sequence[int]], config: VisionConfig) -> Int[np.ndarray, " num_patches"]:
    """Each patch's attention window (Qwen2.5-VL), numbered across all the frames: squares of
    ``window_size`` pixels, counted in merge windows from each frame's top left, in the processor's
    patch order. Without windows, each patch's frame."""
    if not config.window_size:
        return frame_ids(grids)
    m = config.spatial_merge_size
    side = config.window_size // m // config.patch_size  # merge windows a side
    ids, first = [], 0
    for t, h, w in grids:
        row, col = np.meshgrid(np.arange(h // m) // side, np.arange(w // m) // side, indexing="ij")
        per_frame = -(-(w // m) // side) * -(-(h // m) // side)
        window = (row * -(-(w // m) // side) + col).reshape(-1)  # one a merge window, in patch order
        for frame in range(t):
            ids.append(np.repeat(window + first + frame * per_frame, m * m))
        first += t * per_frame
    return np.concatenate(ids) if ids else np.zeros((0,), np.int64)


class LayerNorm(nnx.Module):
    """HF's ``nn.LayerNorm`` (``weight``, ``bias``), computed in float32."""

    def __init__(self, dim: int, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + NORM_EPS)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _linear(in_features: int, out_features: int, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def rotary_cos_sin(
    positions: Int[Array, "num_patches 2"], head_dim: int, theta: float
) -> tuple[Float[Array, "num_patches half_head_dim"], Float[Array, "num_patches half_head_dim"]]:
    """The 2-D rotary embedding for ``apply_rope``: the first half of the frequencies turn by the patch's
    row, the second half by its column."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (jnp.arange(0, 2 * quarter, 2, dtype=jnp.float32) / (2 * quarter)))
    angles = (positions[:, :, None].astype(jnp.float32) * inv_freq).reshape(positions.shape[0], -1)
    return jnp.cos(angles), jnp.sin(angles)


class VisionAttention(nnx.Module):
    """Multi-head self-attention within each frame, with the 2-D rotary embedding."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        dim = config.embed_dim
        self.qkv = _linear(dim, 3 * dim, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj = _linear(dim, dim, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.num_heads, self.head_dim = config.num_heads, config.head_dim

    def __call__(
        self,
        x: Float[Array, "num_patches embed_dim"],
        cos: Float[Array, "num_patches half_head_dim"],
        sin: Float[Array, "num_patches half_head_dim"],
        visible: Bool[Array, "num_patches num_patches"],
    ) -> Float[Array, "num_patches embed_dim"]:
        n = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim), 1, 0)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * self.head_dim**-0.5
        weights = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return self.proj(out.astype(x.dtype).reshape(n, -1))


class VisionMLP(nnx.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        hidden = int(config.embed_dim * config.mlp_ratio)
        self.fc1 = _linear(config.embed_dim, hidden, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = _linear(hidden, config.embed_dim, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.act = _ACTIVATIONS[config.hidden_act]

    def __call__(self, x: Float[Array, "num_patches embed_dim"]) -> Float[Array, "num_patches embed_dim"]:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nnx.Module):
    """Qwen2.5-VL's ``down(act(gate(x)) * up(x))``, with biases."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        dim, hidden = config.embed_dim, config.intermediate_size or 0
        linear = lambda i, o: _linear(i, o, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj, self.up_proj, self.down_proj = linear(dim, hidden), linear(dim, hidden), linear(hidden, dim)
        self.act = _ACTIVATIONS[config.hidden_act]

    def __call__(self, x: Float[Array, "num_patches embed_dim"]) -> Float[Array, "num_patches embed_dim"]:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: VisionConfig, dtype, param_dtype) -> RMSNorm | LayerNorm:
    if config.rms_norm:
        return RMSNorm(config.embed_dim, NORM_EPS, dtype=dtype, param_dtype=param_dtype)
    return LayerNorm(config.embed_dim, param_dtype=param_dtype)


class VisionBlock(nnx.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.norm1 = _norm(config, dtype, param_dtype)
        self.attn = VisionAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = _norm(config, dtype, param_dtype)
        mlp = GatedVisionMLP if config.intermediate_size else VisionMLP
        self.mlp = mlp(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, visible):
        x = x + self.attn(self.norm1(x), cos, sin, visible)
        return x + self.mlp(self.norm2(x))


class GELU(nnx.Module):
    """HF's ``nn.GELU()`` (exact), a module so that ``merger.mlp``'s Linears keep HF's indices 0 and 2."""

    def __call__(self, x: Array) -> Array:
        return jax.nn.gelu(x, approximate=False)


class PatchMerger(nnx.Module):
    """Each window of ``spatial_merge_size**2`` patches, normed and concatenated, through a two-layer MLP."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        merged = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = _norm(config, dtype, param_dtype)
        linear = lambda i, o: _linear(i, o, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp = nnx.List([linear(merged, merged), GELU(), linear(merged, config.out_hidden_size)])
        self.merged = merged

    def __call__(self, x: Float[Array, "num_patches embed_dim"]) -> Float[Array, "num_merged out_hidden_size"]:
        x = self.ln_q(x).reshape(-1, self.merged)
        for layer in self.mlp:
            x = layer(x)
        return x


class PatchEmbed(nnx.Module):
    """HF's Conv3d over whole patches (stride = kernel), as one matmul: ``proj.kernel`` is
    ``[patch_features, embed_dim]``, HF's ``[embed_dim, channels, time, rows, columns]`` weight flattened."""

    def __init__(self, config: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.proj = _linear(
            config.patch_features, config.embed_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, patches: Float[Array, "num_patches patch_features"]) -> Float[Array, "num_patches embed_dim"]:
        return self.proj(patches)


class VisionTransformer(nnx.Module):
    """HF's ``visual``: patches of images and videos packed one after another, to merged tokens."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.patch_embed = PatchEmbed(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List(
            [VisionBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(config.depth)]
        )
        self.merger = PatchMerger(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self,
        patches: Float[Array, "num_patches patch_features"],
        positions: Int[Array, "num_patches 2"],
        frames: Int[Array, " num_patches"],
        windows: Int[Array, " num_patches"],
    ) -> Float[Array, "num_merged out_hidden_size"]:
        """The merged tokens of the packed patches, given each patch's (row, column) (``patch_positions``),
        frame (``frame_ids``) and attention window (``window_ids``)."""
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        same_frame = frames[:, None] == frames[None, :]
        same_window = windows[:, None] == windows[None, :]
        full = set(self.config.fullatt_block_indexes) if self.config.window_size else set(range(self.config.depth))
        x = self.patch_embed(patches)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, same_frame if i in full else same_window)
        return self.merger(x)
