"""Which model class serves which HuggingFace ``architectures`` name."""

from typing import Any

from jaxrunner.models.qwen2_vl import VisionLanguageLM
from jaxrunner.models.transformer import CausalLM

_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen2VLForConditionalGeneration": VisionLanguageLM,
    "Qwen2_5_VLForConditionalGeneration": VisionLanguageLM,
}


def supported_architectures() -> list[str]:
    """The HF architecture names this package can load, sorted."""
    return sorted(_ARCHITECTURES)


def model_class(hf_config: Any) -> type[CausalLM]:
    """The model class for a transformers config, from its first known ``architectures`` entry."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"unsupported architecture {', '.join(names) or '(none given)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
