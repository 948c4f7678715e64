"""One measurement per environment variant, each in a fresh process.

XLA reads ``XLA_FLAGS`` and PjRt its dispatch mode once, when the backend
starts, so each variant of a measurement runs as its own process.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

CUDA_GRAPHS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
"""XLA's own default of what goes into CUDA graphs, named explicitly: importing jaxrunner turns them off
unless ``XLA_FLAGS`` sets this flag (``compat.prefer_kernel_launches_to_cuda_graphs``)."""


def run_variant(command: list[str], overrides: dict[str, str], timeout: float, log: Path) -> int | str:
    """Run ``command`` with this environment plus ``overrides``, its stdout and stderr streaming into
    ``log`` (so that they survive this process being stopped): its exit code, or ``"timed out"``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **overrides)
    with open(log, "w") as sink:
        try:
            return subprocess.run(command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "timed out"
