"""Which model class serves which HuggingFace ``architectures`` name, and how its checkpoint names tensors."""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrunner.models.moe import mixtral_tensor_name
from jaxrunner.models.phi3 import phi3_tensors
from jaxrunner.models.qwen2_vl import VisionLanguageLM
from jaxrunner.models.transformer import CausalLM, TransformerConfig

TensorViews = Callable[[str, np.ndarray, TransformerConfig], list[tuple[str, np.ndarray]]]
"""A checkpoint tensor as the tensors the model's parameters are read from: renamed, or cut into parts."""


def tensors_as_named(name: str, array: np.ndarray, config: TransformerConfig) -> list[tuple[str, np.ndarray]]:
    """A checkpoint tensor as it is: its name is the parameter's."""
    return [(name, array)]


def _mixtral_tensors(name: str, array: np.ndarray, config: TransformerConfig) -> list[tuple[str, np.ndarray]]:
    return [(mixtral_tensor_name(name), array)]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The model class of an HF architecture, and the views of its checkpoint's tensors."""

    model_class: type[CausalLM]
    tensor_views: TensorViews = tensors_as_named


_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(CausalLM),
    "MistralForCausalLM": Architecture(CausalLM),
    "Qwen2ForCausalLM": Architecture(CausalLM),
    "Qwen3ForCausalLM": Architecture(CausalLM),
    "Phi3ForCausalLM": Architecture(CausalLM, phi3_tensors),
    "Gemma2ForCausalLM": Architecture(CausalLM),
    "Gemma3ForCausalLM": Architecture(CausalLM),
    "MixtralForCausalLM": Architecture(CausalLM, _mixtral_tensors),
    "Qwen3MoeForCausalLM": Architecture(CausalLM),
    "Qwen2VLForConditionalGeneration": Architecture(VisionLanguageLM),
    "Qwen2_5_VLForConditionalGeneration": Architecture(VisionLanguageLM),
}


def supported_architectures() -> list[str]:
    """The HF architecture names this package can load, sorted."""
    return sorted(_ARCHITECTURES)


def architecture(hf_config: Any) -> Architecture:
    """The architecture of a transformers config, from its first known ``architectures`` entry."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"unsupported architecture {', '.join(names) or '(none given)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def model_class(hf_config: Any) -> type[CausalLM]:
    """The model class for a transformers config, from its first known ``architectures`` entry."""
    return architecture(hf_config).model_class
