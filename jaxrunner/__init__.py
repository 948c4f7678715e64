"""jaxrunner: vLLM's V1 GPU model runner and offline engine in JAX/XLA."""

from jaxrunner.interfaces import SamplingParams
from jaxrunner.llm import LLM
from jaxrunner.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
