"""The one place jaxrunner reads environment variables, and writes the few that XLA and PjRt read.

Reading: ``envs.JAXRUNNER_ATTENTION_IMPL``, ``envs.JAXRUNNER_COMPILATION_CACHE_DIR`` and the
others in ``environment_variables`` are looked up when asked for (as vLLM's ``envs``), so a
variable set after import counts.
Writing: XLA and the PjRt GPU client read their settings once, when JAX starts
its first backend; ``jaxrunner/__init__.py`` sets jaxrunner's defaults there,
never overriding a value the user chose.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    JAXRUNNER_ATTENTION_IMPL: str | None = None
    JAXRUNNER_FP8_MATMUL: str | None = None
    JAXRUNNER_MOE_IMPL: str | None = None
    JAXRUNNER_ALLOW_LONG_MAX_MODEL_LEN: bool = False
    JAXRUNNER_MAX_N_SEQUENCES: int = 0
    JAXRUNNER_COMPILATION_CACHE_DIR: str | None = None
    XDG_CACHE_HOME: str = ""

ATTENTION_IMPL_ENV_VAR = "JAXRUNNER_ATTENTION_IMPL"
FP8_MATMUL_ENV_VAR = "JAXRUNNER_FP8_MATMUL"
MOE_IMPL_ENV_VAR = "JAXRUNNER_MOE_IMPL"
ALLOW_LONG_MAX_MODEL_LEN_ENV_VAR = "JAXRUNNER_ALLOW_LONG_MAX_MODEL_LEN"
MAX_N_SEQUENCES_ENV_VAR = "JAXRUNNER_MAX_N_SEQUENCES"
DEFAULT_MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
COMPILATION_CACHE_DIR_ENV_VAR = "JAXRUNNER_COMPILATION_CACHE_DIR"
ASYNC_DISPATCH_ENV_VAR = "PJRT_GPU_ENABLE_ASYNC_DISPATCH"
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
# JAX's names for the fraction of each GPU its memory pool holds: the current one, then the deprecated
# one (JAX refuses both at once).
MEM_FRACTION_ENV_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
JAX_DEFAULT_MEM_FRACTION = 0.75
# The pool jaxrunner asks for: it covers any gpu_memory_utilization up to this fraction.
GPU_MEMORY_POOL_FRACTION = 0.95

environment_variables: dict[str, Callable[[], Any]] = {
    # Forces the attention and KV-write implementation, "reference" or "mosaic_gpu", for every
    # runner and every call of the ops that names none; unset, each picks the best for its devices.
    ATTENTION_IMPL_ENV_VAR: lambda: os.environ.get(ATTENTION_IMPL_ENV_VAR) or None,
    # Forces the matmul of FP8 weights, "w8a8" or "weight_only" (ops/fp8_matmul.py), for every bucket of
    # the models loaded after it is set; unset, each bucket runs the one chosen for its size.
    FP8_MATMUL_ENV_VAR: lambda: os.environ.get(FP8_MATMUL_ENV_VAR) or None,
    # Forces the experts' products of mixture-of-experts layers, "reference", "mgpu" or "gathered"
    # (models/moe.py), for the models built after it is set; unset, each program picks by its token count.
    MOE_IMPL_ENV_VAR: lambda: os.environ.get(MOE_IMPL_ENV_VAR) or None,
    # "1" lets max_model_len exceed the model's positions (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN): outputs past
    # the positions the model was trained on may be wrong.
    ALLOW_LONG_MAX_MODEL_LEN_ENV_VAR: lambda: os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV_VAR, "0") == "1",
    # The most completions one request may ask for (SamplingParams.n), as vLLM's VLLM_MAX_N_SEQUENCES:
    # each completion is a request of its own, so an unbounded n would exhaust the host's memory.
    MAX_N_SEQUENCES_ENV_VAR: lambda: _positive_int(MAX_N_SEQUENCES_ENV_VAR, DEFAULT_MAX_N_SEQUENCES),
    # The persistent compilation cache LLM and ModelRunner use unless given one: opt-in, since JAX keeps one
    # cache per process and the user's own jitted functions would land there too. Unset or "": they leave
    # JAX's cache settings alone. The jaxrunner command, whose process runs only jaxrunner's programs, takes
    # it when set ("" turns the command's cache off), else $XDG_CACHE_HOME/jaxrunner/xla.
    COMPILATION_CACHE_DIR_ENV_VAR: lambda: _expanded(os.environ.get(COMPILATION_CACHE_DIR_ENV_VAR)),
    # The user's cache root, under which the jaxrunner command keeps its compiled programs.
    "XDG_CACHE_HOME": lambda: os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
}


def _positive_int(name: str, default: int) -> int:
    """The environment variable ``name`` as a positive integer, ``default`` when unset or empty."""
    value = os.environ.get(name) or str(default)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"The environment variable {name} must be a positive integer; got {value!r}.")
    return int(value)


def _expanded(path: str | None) -> str | None:
    """``path`` with a leading ``~`` expanded; None stays None."""
    return None if path is None else os.path.expanduser(path)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def prefer_async_gpu_dispatch() -> None:
    """Have the PjRt GPU client launch each program from a thread of its own, unless the user chose.

    By default a call into a compiled program launches its kernels on the calling
    thread, which then cannot prepare the next step meanwhile.
    ``PJRT_GPU_ENABLE_ASYNC_DISPATCH=0`` keeps the synchronous launch.
    """
    os.environ.setdefault(ASYNC_DISPATCH_ENV_VAR, "1")


def prefer_kernel_launches_to_cuda_graphs() -> None:
    """Have XLA launch a GPU program's kernels one by one rather than as CUDA graphs, unless the user chose.

    A step's buffers move from call to call, so XLA would update nearly every node
    of the graph before each launch, and an updated graph starts only once its
    previous launch has finished. Launched one by one from PjRt's own thread, the
    kernels queue up while the previous step runs. A ``--xla_gpu_enable_command_buffer``
    of the user's in ``XLA_FLAGS`` is kept.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if not any(flag.split("=", 1)[0] == COMMAND_BUFFER_FLAG for flag in flags.split()):
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAG}=".strip()


def size_gpu_memory_pool() -> None:
    """Have JAX's GPU memory pool hold ``GPU_MEMORY_POOL_FRACTION`` of each device, unless the user chose.

    ``CacheConfig.gpu_memory_utilization`` is vLLM's: the fraction of the device's total
    memory an engine may use. JAX sizes its pool once per process, when its GPU backend
    starts, before any engine names its utilization, and by default to 75% of the device.
    A pool of 95% covers every utilization up to 0.95 (an engine asking for more is
    refused, saying how to fix it); the rest stays for what CUDA allocates outside the
    pool: the context, the libraries' kernels and handles, NCCL's buffers. The pool is
    still preallocated, JAX's default, so that it is one region the allocator never
    has to grow. To share a GPU between processes, set ``XLA_CLIENT_MEM_FRACTION``
    (or the deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``) yourself: either is kept.
    """
    if not any(os.environ.get(name) for name in MEM_FRACTION_ENV_VARS):
        os.environ[MEM_FRACTION_ENV_VARS[0]] = str(GPU_MEMORY_POOL_FRACTION)


def gpu_memory_pool_fraction() -> float:
    """The fraction of each GPU's memory JAX's pool holds, as JAX reads it when its GPU backend starts."""
    chosen = [os.environ[name] for name in MEM_FRACTION_ENV_VARS if os.environ.get(name)]
    return float(chosen[0]) if chosen else JAX_DEFAULT_MEM_FRACTION
