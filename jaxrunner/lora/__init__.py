"""LoRA adapters as vLLM's users name them: ``from jaxrunner.lora.request import LoRARequest``."""

from jaxrunner.lora.request import LoRARequest

__all__ = ["LoRARequest"]
