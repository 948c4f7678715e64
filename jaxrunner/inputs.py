"""The prompt forms ``LLM`` takes, under vLLM's names: ``from jaxrunner.inputs import TokensPrompt``
as ``from vllm.inputs import TokensPrompt``."""

from jaxrunner.engine.prompts import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
