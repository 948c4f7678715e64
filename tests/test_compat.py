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


def test_cuda_graphs_are_off_unless_the_user_chose(monkeypatch):
    # A flag whose value merely contains the name is not the user's choice.
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/xla_gpu_enable_command_buffer")
    importlib.reload(jaxrunner)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/xla_gpu_enable_command_buffer --xla_gpu_enable_command_buffer="
    importlib.reload(jaxrunner)  # a second import adds nothing
    assert os.environ["XLA_FLAGS"].count("--xla_gpu_enable_command_buffer") == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    importlib.reload(jaxrunner)
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"
