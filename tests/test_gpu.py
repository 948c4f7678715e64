"""Checks at real sizes that only make sense on an NVIDIA GPU (run with ``-m gpu``)."""

import jax
import jax.numpy as jnp
import pytest

from jaxrunner.config import CacheConfig
from jaxrunner.kv_cache import KVCacheSpec, determine_num_blocks
from test_attention_reference import Case, _check, _run

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


def test_kv_cache_is_sized_from_device_memory():
    device = jax.devices("gpu")[0]
    spec = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    stats = device.memory_stats()
    blocks = determine_num_blocks(spec, CacheConfig(gpu_memory_utilization=0.5), device,
                                  activation_bytes=1 << 30, max_useful_blocks=1 << 40)
    expected = (stats["bytes_limit"] * 0.5 - stats["bytes_in_use"] - (1 << 30)) // spec.bytes_per_block
    assert blocks == expected > 1000
