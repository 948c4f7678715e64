"""Tiny, randomly initialised HuggingFace models saved to disk: the oracles of the model tests.

``save_tiny_hf_model("llama", tmp_path)`` writes ``config.json`` and safetensors
weights that ``jaxrunner.models.load_model`` reads back; ``hf_logits`` runs the
same checkpoint through transformers (torch float32, CPU) for comparison.
"""

from os import PathLike

import numpy as np
import torch
import transformers

_SHAPE = dict(
    vocab_size=1031,
    hidden_size=128,
    intermediate_size=224,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

# Llama 3 scaling with wavelengths in all three bands (kept, interpolated, slowed) at head_dim 16.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

ARCHS: dict[str, tuple[type[transformers.PretrainedConfig], dict]] = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3": (transformers.LlamaConfig, {"rope_parameters": _LLAMA3_ROPE}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {}),
}
"""Preset name -> (HF config class, preset overrides of the shared tiny shape)."""


def tiny_hf_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """The config of a preset (see ``ARCHS``), float32, with ``overrides`` applied last."""
    cls, preset = ARCHS[arch]
    return cls(**{**_SHAPE, **preset, **overrides, "dtype": "float32"})


def save_tiny_hf_model(
    arch: str, path: str | PathLike, *, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> transformers.PretrainedConfig:
    """Builds a seeded random model of preset ``arch`` and ``save_pretrained``s it to ``path``.

    Every parameter is redrawn (norm weights around 1, biases non-zero), so no
    weight mapping is tested against HF's zero or one defaults. ``max_shard_size``
    (e.g. ``"100KB"``) saves a sharded checkpoint with an index.
    """
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.08)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return config


def hf_logits(path: str | PathLike, prompts: list[list[int]]) -> list[np.ndarray]:
    """Transformers' float32 logits ``[len(prompt), vocab]`` of each prompt, run one at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
