"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with M-RoPE, and a vision tower whose merged tokens take the
places of the prompt's image and video placeholder tokens.

The checkpoint's names are HF's saved ones: the decoder's as a text model's
(``model.layers...``, ``lm_head``), the tower's under ``visual``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxrunner.models.qwen2_vl_vision import VisionTransformer
from jaxrunner.models.transformer import CausalLM, TransformerConfig


class VisionLanguageLM(CausalLM):
    """A ``CausalLM`` with HF's ``visual`` tower: ``embed_vision`` turns patches into placeholder embeddings,
    ``embed_with_vision`` puts them in a prompt's token embeddings (the model's ``inputs_embeds``)."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        if config.vision is None or config.mrope_section is None:
            raise ValueError("a vision-language model needs a vision config and M-RoPE's mrope_section")
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mesh=mesh)
        param_dtype = dtype if param_dtype is None else param_dtype
        self.visual = VisionTransformer(config.vision, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def embed_vision(
        self,
        patches: Float[Array, "num_patches patch_features"],
        positions: Int[Array, "num_patches 2"],
        frames: Int[Array, " num_patches"],
        windows: Int[Array, " num_patches"],
    ) -> Float[Array, "num_merged hidden_size"]:
        """The placeholder embeddings of images and videos packed one after another (``VisionTransformer``)."""
        return self.visual(patches, positions, frames, windows).astype(self.dtype)

    def embed_with_vision(
        self, input_ids: Int[Array, " num_tokens"], vision_embeds: Float[Array, "num_merged hidden_size"]
    ) -> Float[Array, "num_tokens hidden_size"]:
        """The token embeddings of ``input_ids`` with its image and video placeholders, in order, replaced by
        the rows of ``vision_embeds``."""
        ids = (self.config.image_token_id, self.config.video_token_id)
        is_vision = jnp.isin(input_ids, jnp.asarray([i for i in ids if i is not None]))
        row = jnp.clip(jnp.cumsum(is_vision) - 1, 0, vision_embeds.shape[0] - 1)
        return jnp.where(is_vision[:, None], vision_embeds[row], self.embed(input_ids))
