"""The one place jaxrunner reads environment variables, and writes the few that XLA and PjRt read.

Reading: ``envs.JAXRUNNER_ATTENTION_IMPL`` and ``envs.XDG_CACHE_HOME`` are looked
up when asked for (as vLLM's ``envs``), so a variable set after import counts.
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
    XDG_CACHE_HOME: str = ""

ATTENTION_IMPL_ENV_VAR = "JAXRUNNER_ATTENTION_IMPL"
ASYNC_DISPATCH_ENV_VAR = "PJRT_GPU_ENABLE_ASYNC_DISPATCH"
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"

environment_variables: dict[str, Callable[[], Any]] = {
    # Forces the attention and KV-write implementation, "reference" or "mosaic_gpu", for every
    # runner and every call of the ops that names none; unset, each picks the best for its devices.
    ATTENTION_IMPL_ENV_VAR: lambda: os.environ.get(ATTENTION_IMPL_ENV_VAR) or None,
    # The user's cache root; the persistent compilation cache defaults to $XDG_CACHE_HOME/jaxrunner/xla.
    "XDG_CACHE_HOME": lambda: os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
}


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
