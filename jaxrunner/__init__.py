"""jaxrunner: vLLM's V1 GPU model runner and offline engine in JAX/XLA.

What a vLLM user imports from ``vllm`` that jaxrunner supports comes from here
(``from jaxrunner import LLM, SamplingParams``), and ``jaxrunner.sampling_params``
is ``vllm.sampling_params``. Array shapes are jaxtyping annotations with one name
per axis; README.md's "Array shapes" lists them.
"""

from importlib.metadata import version

from jaxrunner import envs

envs.prefer_async_gpu_dispatch()  # before anything starts JAX's GPU backend
envs.prefer_kernel_launches_to_cuda_graphs()
envs.size_gpu_memory_pool()

from jaxrunner.engine.llm import LLM  # noqa: E402
from jaxrunner.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jaxrunner.engine.structured_outputs import StructuredOutputsParams  # noqa: E402
from jaxrunner.inputs import TextPrompt, TokensPrompt  # noqa: E402
from jaxrunner.interfaces import SamplingParams  # noqa: E402

__version__ = version("jaxrunner")

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "TextPrompt",
    "TokensPrompt",
]
