"""Gemma 2 and Gemma 3 (text): what sets them apart from the Llama family, read from their HF configs.

The decoder (``models/transformer.py``) runs them with these flags:

* norms scale by ``1 + weight`` (HF stores Gemma's norm weights around 0), and
  every block has four: before and after the attention, before and after the MLP;
* the MLP is GeGLU (``gelu_pytorch_tanh``);
* token embeddings are multiplied by ``sqrt(hidden_size)`` in the compute dtype;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim``'s;
* local (sliding-window) and global layers alternate (``layer_types``);
* Gemma 2 soft-caps attention scores (``attn_logit_softcapping``) and the final
  logits (``final_logit_softcapping``): ``cap * tanh(x / cap)``;
* Gemma 3 normalises queries and keys per head, and gives local layers their own
  RoPE base (``rope_parameters["sliding_attention"]``, read with the rest of the RoPE).
"""

from typing import Any

MODEL_TYPES = ("gemma2", "gemma3_text")
"""HF ``model_type`` of the Gemma configs read here."""


def gemma_fields(hf_config: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields a Gemma config sets beyond those of the Llama family."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported: the decoder attends causally")
    return dict(
        norm_weight_offset=1.0,
        sandwich_norms=True,
        embed_scale=hf_config.hidden_size**0.5,
        query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
        attn_soft_cap=_cap(hf_config.attn_logit_softcapping),
        final_soft_cap=_cap(hf_config.final_logit_softcapping),
        layer_types=tuple(hf_config.layer_types),
        qk_norm=hf_config.model_type == "gemma3_text",
    )


def _cap(value: float | None) -> float | None:
    return None if value is None else float(value)
