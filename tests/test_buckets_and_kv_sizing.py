"""Bucket ladders, padding errors, and KV cache sizing after a profile run."""

import jax
import pytest
from runner_driver import make_runner

from jaxrunner import envs
from jaxrunner.config import CUBLAS_GEMMS, CUBLAS_MIN_ROWS, CacheConfig, CompilationConfig
from jaxrunner.models import TransformerConfig, init_random_model
from jaxrunner.runner import compilation, kv_cache
from jaxrunner.runner.compilation import default_ladder, make_ladder, pad_to_bucket
from jaxrunner.runner.kv_cache import KV_CACHE_MARGIN_BYTES, size_kv_cache

GIB = 1 << 30


@pytest.mark.parametrize("max_size", [1, 7, 64, 300, 2048, 8192])
def test_default_ladder_is_dense_then_sparse_and_reaches_the_limit(max_size):
    ladder = default_ladder(max_size)
    assert ladder == sorted(set(ladder)) and ladder[-1] == max_size and ladder[0] >= 1
    small = [b for b in ladder if b <= 64]
    assert all(b2 - b1 <= 8 for b1, b2 in zip(small, small[1:]))
    # Above 256 a bucket pads by at most 50%.
    assert all(b2 <= 1.5 * b1 for b1, b2 in zip(ladder, ladder[1:]) if b1 >= 256)


def test_pad_to_bucket_and_its_errors():
    ladder = [1, 4, 16]
    assert [pad_to_bucket(n, ladder, "tokens") for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="17 tokens exceeds the largest bucket \\(16\\)"):
        pad_to_bucket(17, ladder, "tokens")
    with pytest.raises(ValueError, match="must reach 32"):
        make_ladder([8, 16], 32, "token_buckets")


SMALL = TransformerConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def small_runner():
    return make_runner(
        init_random_model(SMALL),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        request_buckets=[4],
        num_blocks=2,
        max_model_len=128,
    )


def test_kv_cache_sized_from_budget_after_profile_run():
    runner = small_runner()
    profile = runner.profile_run()
    assert profile.measured_bytes is None and profile.bytes == profile.xla_bytes > 0  # the CPU keeps no stats
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=20 * runner.kv_cache_spec.bytes_per_block)
    assert runner.initialize_kv_cache() == 20
    assert runner.memory_budget is not None and runner.memory_budget.summary()["kv_cache_tokens"] == 20 * 16
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=1 << 30)
    # Never more than every request slot can address (4 slots x 8 blocks, plus one).
    assert runner.initialize_kv_cache() == 4 * 8 + 1
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=runner.kv_cache_spec.bytes_per_block)
    with pytest.raises(ValueError, match="Only 1 KV cache blocks .* fit in CacheConfig.cpu_kv_cache_bytes"):
        runner.initialize_kv_cache()


def fake_gpu(monkeypatch, total: int, in_use: int, peak_over_in_use: int = 0, pool_fraction: float = 0.95):
    """Memory statistics of a GPU of ``total`` bytes whose JAX pool holds ``pool_fraction`` of it."""
    for name in envs.MEM_FRACTION_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.MEM_FRACTION_ENV_VARS[0], str(pool_fraction))
    stats = {
        "bytes_limit": int(total * pool_fraction),
        "bytes_in_use": in_use,
        "peak_bytes_in_use": in_use + peak_over_in_use,
    }
    for module in (compilation, kv_cache):
        monkeypatch.setattr(module, "device_memory_stats", lambda device: stats)


def test_kv_cache_gets_utilization_of_total_memory_less_weights_activations_and_margin(monkeypatch):
    """vLLM's rule: 0.9 x 80 GiB, less 16 GiB of weights, 3 GiB of activations and the margin."""
    total, weights, activations, per_block = 80 * GIB, 16 * GIB, 3 * GIB, 2 * 1024 * 1024
    fake_gpu(monkeypatch, total, in_use=weights)
    budget = size_kv_cache(
        16, per_block, CacheConfig(gpu_memory_utilization=0.9), jax.devices()[0], activations, max_useful_blocks=10
    )
    expected = (int(0.9 * total) - weights - activations - KV_CACHE_MARGIN_BYTES) // per_block
    assert budget.num_blocks == expected  # on a GPU no cap at the addressable blocks, as in vLLM
    assert (budget.total_bytes, budget.weights_bytes, budget.activation_bytes) == (total, weights, activations)
    summary = budget.summary()
    assert summary["total_gib"] == 80 and summary["gpu_memory_utilization"] == 0.9
    assert summary["kv_cache_tokens"] == 16 * expected
    assert 0.9 * 80 - 16 - 3 - 1 - 1e-3 < budget.kv_cache_bytes / GIB <= 0.9 * 80 - 16 - 3 - KV_CACHE_MARGIN_BYTES / GIB


def test_too_small_a_utilization_or_pool_is_refused_with_the_fix(monkeypatch):
    device = jax.devices()[0]
    fake_gpu(monkeypatch, 80 * GIB, in_use=16 * GIB)
    with pytest.raises(ValueError, match=r"Only 0 KV cache blocks fit: gpu_memory_utilization=0.2 .* Raise gpu_memory"):
        size_kv_cache(16, 1 << 20, CacheConfig(gpu_memory_utilization=0.2), device, 1 * GIB, max_useful_blocks=10)
    fake_gpu(monkeypatch, 80 * GIB, in_use=16 * GIB, pool_fraction=0.5)  # the user's XLA_CLIENT_MEM_FRACTION
    with pytest.raises(ValueError, match="more than JAX's memory pool holds.*XLA_CLIENT_MEM_FRACTION=0.9"):
        size_kv_cache(16, 1 << 20, CacheConfig(gpu_memory_utilization=0.9), device, 1 * GIB, max_useful_blocks=10)


def test_profile_run_runs_the_largest_programs_and_reads_the_allocators_peak(monkeypatch):
    runner = small_runner()
    fake_gpu(monkeypatch, 4 * GIB, in_use=1 << 20, peak_over_in_use=3 << 20)
    profile = runner.profile_run()  # runs forward and sampling on dummy inputs: it would fail on wrong ones
    assert profile.measured_bytes == profile.bytes == 3 << 20 and profile.xla_bytes > 0
    # A device whose half leaves 40.5 blocks beyond the weights, the profiled peak and the margin.
    per_block = runner.kv_cache_spec.bytes_per_block
    total = 2 * ((1 << 20) + profile.bytes + KV_CACHE_MARGIN_BYTES + 40 * per_block) + per_block
    fake_gpu(monkeypatch, total, in_use=1 << 20, peak_over_in_use=3 << 20)
    runner.cache_config = CacheConfig(gpu_memory_utilization=0.5)
    assert runner.initialize_kv_cache() == 40
    budget = runner.memory_budget
    assert budget is not None and budget.activation_bytes == profile.bytes and budget.weights_bytes == 1 << 20


def test_step_programs_compile_with_the_configured_xla_options():
    assert CompilationConfig().step_compiler_options(CUBLAS_MIN_ROWS) == CUBLAS_GEMMS
    assert CompilationConfig().step_compiler_options(CUBLAS_MIN_ROWS - 1) == {}
    assert CompilationConfig(compiler_options={}).step_compiler_options(CUBLAS_MIN_ROWS) == {}
    runner = make_runner(
        init_random_model(SMALL),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        request_buckets=[4],
        max_model_len=128,
        compiler_options={"xla_no_such_option": True},
        compile_threads=2,
    )
    # The option reaches XLA, which names it: every step program is compiled with it (the error of a
    # precompiling thread reaches the caller).
    with pytest.raises(Exception, match="xla_no_such_option"):
        runner.capture_model()
    with pytest.raises(Exception, match="xla_no_such_option"):
        runner.profile_run()
