"""jaxrunner: vLLM's V1 GPU model runner and offline engine in JAX/XLA."""

from jaxrunner.compat import prefer_async_gpu_dispatch, prefer_kernel_launches_to_cuda_graphs

prefer_async_gpu_dispatch()  # before anything starts JAX's GPU backend
prefer_kernel_launches_to_cuda_graphs()

from jaxrunner.engine.llm import LLM  # noqa: E402
from jaxrunner.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jaxrunner.engine.structured_outputs import StructuredOutputsParams  # noqa: E402
from jaxrunner.interfaces import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
