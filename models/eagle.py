"""An EAGLE-style draft head: one decoder layer over (token embedding, target feature).

EAGLE predicts the target's next feature from the feature at the previous
position and the embedding of the token that followed it: ``fc([embed(x),
f])`` goes through a Llama decoder layer, and the target's own ``lm_head``
turns the result into draft logits. The embedding and the head are the
target's; the head owns ``fc`` and its layer (HF names ``fc.*``, ``layers.0.*``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxrunner.models.transformer import KVCache, TransformerConfig, check_tensor_parallel, decoder_layers, run_layers
from jaxrunner.ops import AttentionBackend, AttentionMetadata
from jaxrunner.sharding import tensor_parallel_size


class EagleHead(nnx.Module):
    """``fc`` and the decoder layers of an EAGLE checkpoint (EAGLE-1 layout)."""

    # Checkpoints carry a copy of the target's embedding; the target's own is used.
    ignored_tensors = ("embed_tokens.weight",)
    lm_head = None

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        check_tensor_parallel(config, tensor_parallel_size(mesh))
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.mesh = mesh
        hidden = config.hidden_size
        self.fc = nnx.Linear(2 * hidden, hidden, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = decoder_layers(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mesh=mesh)

    def __call__(
        self,
        token_embeddings: Float[Array, "num_tokens hidden_size"],
        features: Float[Array, "num_tokens hidden_size"],
        positions: Int[Array, " num_tokens"],
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        attention_backend: AttentionBackend | None = None,
    ) -> tuple[Float[Array, "num_tokens hidden_size"], list[KVCache]]:
        """The predicted next features, and the head's updated KV caches."""
        x = self.fc(jnp.concatenate([token_embeddings, features.astype(token_embeddings.dtype)], axis=-1))
        return run_layers(self.layers, self.config, x, positions, kv_caches, metadata, attention_backend)
