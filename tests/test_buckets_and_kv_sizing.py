"""Bucket ladders, padding errors, and KV cache sizing after a profile run."""

import pytest
from runner_driver import make_runner

from jaxrunner.config import CUBLAS_GEMMS, CUBLAS_MIN_ROWS, CacheConfig, CompilationConfig
from jaxrunner.models import TransformerConfig, init_random_model
from jaxrunner.runner.compilation import default_ladder, make_ladder, pad_to_bucket


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


def test_kv_cache_sized_from_budget_after_profile_run():
    config = TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    runner = make_runner(
        init_random_model(config),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        request_buckets=[4],
        num_blocks=2,
        max_model_len=128,
    )
    assert runner.profile_run() > 0
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=20 * runner.kv_cache_spec.bytes_per_block)
    assert runner.initialize_kv_cache() == 20
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=1 << 30)
    # Never more than every request slot can address (4 slots x 8 blocks, plus one).
    assert runner.initialize_kv_cache() == 4 * 8 + 1
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=runner.kv_cache_spec.bytes_per_block)
    with pytest.raises(ValueError, match="KV cache blocks fit"):
        runner.initialize_kv_cache()


def test_step_programs_compile_with_the_configured_xla_options():
    assert CompilationConfig().step_compiler_options(CUBLAS_MIN_ROWS) == CUBLAS_GEMMS
    assert CompilationConfig().step_compiler_options(CUBLAS_MIN_ROWS - 1) == {}
    assert CompilationConfig(compiler_options={}).step_compiler_options(CUBLAS_MIN_ROWS) == {}
    config = TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    runner = make_runner(
        init_random_model(config),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        request_buckets=[4],
        max_model_len=128,
        compiler_options={"xla_no_such_option": True},
    )
    # The option reaches XLA, which names it: every step program is compiled with it.
    with pytest.raises(Exception, match="xla_no_such_option"):
        runner.capture_model()
    with pytest.raises(Exception, match="xla_no_such_option"):
        runner.profile_run()
