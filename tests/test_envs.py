"""The environment variables jaxrunner reads, the process-wide defaults it sets when imported, and the
names it provides where vLLM's users import them."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

import jaxrunner
from jaxrunner import cli, envs
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
    monkeypatch.delenv(envs.COMPILATION_CACHE_DIR_ENV_VAR, raising=False)
    assert CompilationConfig().cache_dir == ""  # off unless the user asks
    monkeypatch.setenv(envs.COMPILATION_CACHE_DIR_ENV_VAR, "~/jaxrunner-xla")
    assert CompilationConfig().cache_dir == os.path.expanduser("~/jaxrunner-xla")


def test_the_commands_cache_is_on_unless_the_user_chose(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.COMPILATION_CACHE_DIR_ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    user_dir = cli.jax_cache_dir()
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert cli.command_cache_dir() == str(tmp_path / "jaxrunner" / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
        assert cli.command_cache_dir() == ""  # JAX's own cache, as the user configured it
    finally:
        jax.config.update("jax_compilation_cache_dir", user_dir)
    monkeypatch.setenv(envs.COMPILATION_CACHE_DIR_ENV_VAR, "")
    assert cli.command_cache_dir() == ""


_USER_CODE_AFTER_AN_LLM = textwrap.dedent(
    """
    import json, os, sys
    import jax, jax.numpy as jnp
    from jaxrunner import LLM, envs
    from jaxrunner.config import RunnerConfig
    from jaxrunner.runner.model_runner import ModelRunner

    def files(path):
        return sum(len(names) for _, _, names in os.walk(path))

    LLM("tiny-llama", max_num_seqs=1, max_num_batched_tokens=8, token_buckets=[8], request_buckets=[1],
        num_gpu_blocks_override=8, max_model_len=64)
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 17.0)(jnp.arange(5.0)).block_until_ready()
    silent = dict(jax_dir=jax.config.jax_compilation_cache_dir, xdg_files=files(os.environ["XDG_CACHE_HOME"]))
    os.environ[envs.COMPILATION_CACHE_DIR_ENV_VAR] = sys.argv[1]  # the user's word
    ModelRunner(RunnerConfig())
    jax.jit(lambda x: jnp.cos(x) * 5.0 - 11.0)(jnp.arange(7.0)).block_until_ready()
    print(json.dumps(dict(silent=silent, asked_files=files(sys.argv[1]))))
    """
)


def test_an_llm_leaves_the_users_jax_programs_out_of_any_cache_unless_asked(tmp_path):
    """JAX keeps one persistent cache per process: building an LLM turns it on only at the user's word,
    so a function the user jits afterwards is written to no cache directory; once asked, it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "JAXRUNNER_COMPILATION"))}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "JAX_PLATFORMS": "cpu"}
    (tmp_path / "xdg").mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _USER_CODE_AFTER_AN_LLM, str(tmp_path / "asked")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["silent"] == {"jax_dir": None, "xdg_files": 0}
    assert result["asked_files"] > 0


def test_max_n_sequences_must_be_a_positive_integer(monkeypatch):
    monkeypatch.delenv(envs.MAX_N_SEQUENCES_ENV_VAR, raising=False)
    assert envs.JAXRUNNER_MAX_N_SEQUENCES == envs.DEFAULT_MAX_N_SEQUENCES == 16384
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv(envs.MAX_N_SEQUENCES_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{envs.MAX_N_SEQUENCES_ENV_VAR} must be a positive integer"):
            _ = envs.JAXRUNNER_MAX_N_SEQUENCES


def test_what_vllm_users_import_comes_from_the_same_places():
    """``from vllm import ...`` and ``from vllm.sampling_params import ...``, with jaxrunner for vllm."""
    from jaxrunner import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams, sampling_params
    from jaxrunner.engine.outputs import CompletionOutput as EngineCompletionOutput
    from jaxrunner.engine.structured_outputs import StructuredOutputsParams as EngineStructuredOutputsParams
    from jaxrunner.interfaces import RequestOutputKind

    assert StructuredOutputsParams is sampling_params.StructuredOutputsParams is EngineStructuredOutputsParams
    assert SamplingParams is sampling_params.SamplingParams
    assert sampling_params.RequestOutputKind is RequestOutputKind
    assert CompletionOutput is EngineCompletionOutput and RequestOutput.__name__ == "RequestOutput"
    assert set(jaxrunner.__all__) >= {"LLM", "SamplingParams", "StructuredOutputsParams", "__version__"}
    assert jaxrunner.__version__.count(".") >= 1
