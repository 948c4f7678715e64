"""Flax NNX model families and their HuggingFace checkpoint loader."""

from jaxrunner.models.loader import init_random_model, load_model
from jaxrunner.models.registry import supported_architectures
from jaxrunner.models.safetensors_io import CheckpointError
from jaxrunner.models.transformer import CausalLM, TransformerConfig

__all__ = [
    "CausalLM",
    "CheckpointError",
    "TransformerConfig",
    "init_random_model",
    "load_model",
    "supported_architectures",
]
