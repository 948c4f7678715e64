"""vLLM's ``vllm.sampling_params`` path: ``from jaxrunner.sampling_params import SamplingParams,
StructuredOutputsParams`` works as vLLM's import does."""

from jaxrunner.engine.structured_outputs import StructuredOutputsParams
from jaxrunner.interfaces import RequestOutputKind, SamplingParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "RequestOutputKind"]
