"""The process-wide defaults jaxrunner sets when imported."""

import importlib
import os

import jaxrunner
from jaxrunner import compat


def test_async_gpu_dispatch_is_on_unless_the_user_chose(monkeypatch):
    assert compat.ASYNC_DISPATCH_ENV_VAR == "PJRT_GPU_ENABLE_ASYNC_DISPATCH"
    monkeypatch.delenv(compat.ASYNC_DISPATCH_ENV_VAR, raising=False)
    importlib.reload(jaxrunner)  # what a first import does
    assert os.environ[compat.ASYNC_DISPATCH_ENV_VAR] == "1"
    monkeypatch.setenv(compat.ASYNC_DISPATCH_ENV_VAR, "0")
    importlib.reload(jaxrunner)
    assert os.environ[compat.ASYNC_DISPATCH_ENV_VAR] == "0"
