"""The environment variables jaxrunner reads, and the process-wide defaults it sets when imported."""

import importlib
import os

import jaxrunner
from jaxrunner import envs
from jaxrunner.config import CompilationConfig


def test_async_gpu_dispatch_is_on_unless_the_user_chose(monkeypatch):
    assert envs.ASYNC_DISPATCH_ENV_VAR == "PJRT_GPU_ENABLE_ASYNC_DISPATCH"
    monkeypatch.delenv(envs.ASYNC_DISPATCH_ENV_VAR, raising=False)
    importlib.reload(jaxrunner)  # what a first import does
    assert os.environ[envs.ASYNC_DISPATCH_ENV_VAR] == "1"
    monkeypatch.setenv(envs.ASYNC_DISPATCH_ENV_VAR, "0")
    importlib.reload(jaxrunner)
    assert os.environ[envs.ASYNC_DISPATCH_ENV_VAR] == "0"


def test_cuda_graphs_are_off_unless_the_user_chose(monkeypatch):
    # A flag whose value merely contains the name is not the user's choice.
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/xla_gpu_enable_command_buffer")
    importlib.reload(jaxrunner)
    assert (
        os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/xla_gpu_enable_command_buffer --xla_gpu_enable_command_buffer="
    )
    importlib.reload(jaxrunner)  # a second import adds nothing
    assert os.environ["XLA_FLAGS"].count("--xla_gpu_enable_command_buffer") == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    importlib.reload(jaxrunner)
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"


def test_gpu_memory_pool_covers_the_utilization_unless_the_user_chose(monkeypatch):
    for name in envs.MEM_FRACTION_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert envs.gpu_memory_pool_fraction() == envs.JAX_DEFAULT_MEM_FRACTION == 0.75
    importlib.reload(jaxrunner)
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == str(envs.GPU_MEMORY_POOL_FRACTION) == "0.95"
    assert envs.gpu_memory_pool_fraction() == 0.95
    # Either of JAX's names is the user's choice (JAX refuses both at once): nothing is added.
    for name, value in zip(envs.MEM_FRACTION_ENV_VARS, ("0.6", "0.5")):
        for other in envs.MEM_FRACTION_ENV_VARS:
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(name, value)
        importlib.reload(jaxrunner)
        assert [os.environ.get(n) for n in envs.MEM_FRACTION_ENV_VARS].count(None) == 1
        assert envs.gpu_memory_pool_fraction() == float(value)


def test_variables_are_read_when_asked_for(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.ATTENTION_IMPL_ENV_VAR, raising=False)
    assert envs.JAXRUNNER_ATTENTION_IMPL is None
    monkeypatch.setenv(envs.ATTENTION_IMPL_ENV_VAR, "reference")
    assert envs.JAXRUNNER_ATTENTION_IMPL == "reference"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert CompilationConfig().cache_dir == str(tmp_path / "jaxrunner" / "xla")
