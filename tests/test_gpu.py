"""Checks at real sizes that only make sense on an NVIDIA GPU (run with ``-m gpu``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packed_batch import packed_metadata
from test_attention_reference import Case, _check, _run
from test_model_parity import jitted_step, pack, random_prompts
from test_sharding import CONFIG, GREEDY_PROMPTS, run_greedy, small_runner, tp_mesh

from jaxrunner import LLM, SamplingParams, envs
from jaxrunner.config import ParallelConfig
from jaxrunner.models import TransformerConfig, init_random_model
from jaxrunner.runner.kv_cache import KV_CACHE_MARGIN_BYTES
from jaxrunner.sharding import kv_cache_sharding, make_mesh

pytestmark = pytest.mark.gpu

# Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128.
LLAMA3_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.mark.parametrize(
    "reqs",
    [
        tuple([(4095, 1)] * 16),  # decode, 16 x 4k context
        ((0, 1024), (2048, 512), (1000, 1), (3000, 1), (17, 15)),  # mixed prefill / chunk / decode
    ],
)
def test_attention_reference_at_llama3_sizes(reqs):
    case = Case(reqs=reqs, dtype=jnp.bfloat16, pad_tokens=7, pad_reqs=3, **LLAMA3_HEADS)
    out, ref = _run(case, seed=11)
    _check(case, out, ref, tol=1e-2)


def test_llm_takes_its_gpu_memory_utilization_of_the_whole_device():
    """vLLM's meaning: at gpu_memory_utilization=0.5 the weights, the profiled peak and the KV cache
    take half of the device's total memory less at most the margin (plus a block), not half of JAX's pool."""
    device = jax.devices("gpu")[0]
    llm = LLM(
        "tiny-llama",
        gpu_memory_utilization=0.5,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        token_buckets=[256, 2048],
        request_buckets=[8, 64],
    )
    runner = llm.llm_engine.runner
    budget = runner.memory_budget
    assert budget is not None and budget.total_bytes and budget.weights_bytes and budget.activation_bytes
    stats = device.memory_stats()
    total = stats["bytes_limit"] / envs.gpu_memory_pool_fraction()
    assert abs(budget.total_bytes - total) < 2 and 70 * 2**30 < total < 150 * 2**30  # an H100's or an H200's
    taken = budget.kv_cache_bytes + budget.weights_bytes + budget.activation_bytes
    assert 0.5 * total - KV_CACHE_MARGIN_BYTES - budget.bytes_per_block - 1 <= taken <= 0.5 * total
    assert budget.kv_cache_bytes >= 0.5 * total - budget.weights_bytes - budget.activation_bytes - 2 * 2**30
    # The profile ran the programs and read the allocator: at least the larger program's share of XLA's
    # figure for the two, at most all of it (and the step's inputs).
    profile = runner.profile_run()
    assert profile.measured_bytes is not None
    assert profile.xla_bytes / 2 <= profile.measured_bytes <= profile.xla_bytes + (64 << 20)
    # Serving the largest steps keeps what is in use within the budget.
    prompts = [[7] * 1000 for _ in range(64)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert device.memory_stats()["bytes_in_use"] <= 0.5 * total


def test_tensor_parallel_logits_on_two_gpus():
    """bf16 with the Mosaic GPU kernel per KV-head shard: TP=2 logits against one GPU's."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs two GPUs")
    config = TransformerConfig(
        vocab_size=4099,
        hidden_size=1024,
        intermediate_size=2048,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
    )
    prompts = random_prompts(config.vocab_size, [300, 17, 64], seed=2)
    metadata, positions = packed_metadata([300, 17, 64], block_size=16, num_blocks=64, num_tokens=384, num_reqs=4)
    shape = (64, 16, config.num_kv_heads, config.head_dim)
    logits = {}
    for tp in (1, 2):
        mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp))
        model = init_random_model(config, dtype="bfloat16", seed=0, mesh=mesh)
        caches = jax.device_put(
            [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)) for _ in range(config.num_layers)],
            kv_cache_sharding(mesh),
        )
        out, _ = jitted_step(model)(pack(prompts, 384), jnp.asarray(positions), caches, metadata)
        logits[tp] = np.asarray(out, np.float32)[:381]
    assert np.isfinite(logits[2]).all()
    assert np.linalg.norm(logits[2] - logits[1]) / np.linalg.norm(logits[1]) < 2e-2


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_greedy_equals_one_gpu(tp):
    """Continuous batching with chunked prefill, float32 at full matmul precision: TP greedy tokens
    equal one GPU's on the same machine."""
    if len(jax.devices("gpu")) < tp:
        pytest.skip(f"needs {tp} GPUs")
    greedy = {}
    with jax.default_matmul_precision("float32"):
        for size in (1, tp):
            mesh = tp_mesh(size)
            runner = small_runner(init_random_model(CONFIG, seed=1, mesh=mesh), mesh)
            greedy[size] = run_greedy(runner, GREEDY_PROMPTS)
    assert len(greedy[1]) == len(GREEDY_PROMPTS) and all(len(tokens) == 20 for tokens in greedy[1].values())
    assert greedy[tp] == greedy[1]
