"""write_kv against a NumPy loop: random slots with padding (-1), dtype casts, donation, in place.

Both implementations: XLA's scatter ("reference") and the Mosaic GPU kernel
("mosaic_gpu"), which off a GPU runs through the Mosaic GPU interpreter; the
kernel is also lowered for CUDA here, which runs Mosaic GPU's own checks of its
copies without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrunner.ops import write_kv
from jaxrunner.ops.kv_write_mgpu import write_kv_mgpu

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 12, 8, 2, 64
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
IMPLS = ["reference", "mosaic_gpu"]


def _random_case(seed: int, num_tokens: int, cache_dtype, new_dtype):
    """Random caches and new K/V; distinct slots, the first one the cache's last slot, and with more than
    one token about a quarter of the others -1 (padding), the last one always."""
    rng = np.random.default_rng(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (rng.standard_normal(shape).astype(cache_dtype) for _ in range(2))
    k_new, v_new = (rng.standard_normal((num_tokens, KV_HEADS, HEAD_DIM)).astype(new_dtype) for _ in range(2))
    slots = np.concatenate([[NUM_SLOTS - 1], rng.permutation(NUM_SLOTS - 1)[: num_tokens - 1]]).astype(np.int32)
    if num_tokens > 1:
        slots[1:][rng.random(num_tokens - 1) < 0.25] = -1
        slots[-1] = -1
    return k_cache, v_cache, k_new, v_new, slots


def _numpy_write(cache: np.ndarray, new: np.ndarray, slots: np.ndarray) -> np.ndarray:
    out = cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = new[t].astype(cache.dtype)
    return out


def _check(case, impl: str) -> None:
    k_cache, v_cache, k_new, v_new, slots = case
    k_out, v_out = write_kv(*map(jnp.asarray, case), impl=impl)
    assert k_out.dtype == v_out.dtype == k_cache.dtype
    np.testing.assert_array_equal(np.asarray(k_out), _numpy_write(k_cache, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _numpy_write(v_cache, v_new, slots))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed, num_tokens", [(0, 40), (1, 1), (2, 15), (3, 17)])
def test_write_kv_matches_numpy_loop(seed, num_tokens, impl):
    _check(_random_case(seed, num_tokens, np.float32, np.float32), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_slots_leave_cache_untouched(impl):
    k_cache, v_cache, k_new, v_new, slots = _random_case(3, 16, np.float32, np.float32)
    slots[:] = -1
    k_out, v_out = write_kv(*map(jnp.asarray, (k_cache, v_cache, k_new, v_new, slots)), impl=impl)
    np.testing.assert_array_equal(np.asarray(k_out), k_cache)
    np.testing.assert_array_equal(np.asarray(v_out), v_cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_values_cast_into_bf16_cache(impl):
    _check(_random_case(4, 40, ml_dtypes.bfloat16, np.float32), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_with_donated_caches(impl):
    k_cache, v_cache, k_new, v_new, slots = _random_case(5, 24, np.float32, np.float32)
    step = jax.jit(functools.partial(write_kv, impl=impl), donate_argnums=(0, 1))
    k_dev, v_dev = jnp.asarray(k_cache), jnp.asarray(v_cache)
    k_out, v_out = step(k_dev, v_dev, *map(jnp.asarray, (k_new, v_new, slots)))
    np.testing.assert_array_equal(np.asarray(k_out), _numpy_write(k_cache, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _numpy_write(v_cache, v_new, slots))
    assert k_dev.is_deleted() and v_dev.is_deleted()


def _donated_write_memory(impl: str, cache_shape: tuple, num_tokens: int, dtype):
    cache = jax.ShapeDtypeStruct(cache_shape, dtype)
    new = jax.ShapeDtypeStruct((num_tokens, *cache_shape[2:]), dtype)
    slots = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    step = jax.jit(functools.partial(write_kv, impl=impl), donate_argnums=(0, 1))
    memory = step.lower(cache, cache, new, new, slots).compile().memory_analysis()
    assert memory is not None, "the backend reports no memory analysis"
    return memory, cache, new


@pytest.mark.parametrize("impl", IMPLS)
def test_donated_write_is_in_place(impl):
    """Both caches alias the outputs, and the program allocates nothing the size of a cache.

    float32 only: the CPU backend widens bf16 scatters to float32, a copy GPUs do not make.
    """
    memory, cache, new = _donated_write_memory(impl, (64, 16, 8, 128), 32, jnp.float32)
    assert memory.alias_size_in_bytes == 2 * cache.size * 4
    assert memory.temp_size_in_bytes < new.size * 4


@pytest.mark.parametrize("cache_shape", [(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), (2048, 16, 8, 128)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_lowers_for_cuda(cache_shape, dtype):
    """Mosaic GPU's lowering checks the kernel's copies (sizes, alignment) as a GPU compile would."""
    cache = jax.ShapeDtypeStruct(cache_shape, dtype)
    new = jax.ShapeDtypeStruct((17, *cache_shape[2:]), dtype)
    slots = jax.ShapeDtypeStruct((17,), jnp.int32)
    lowered = write_kv_mgpu.trace(cache, cache, new, new, slots).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_kernel_refuses_rows_it_cannot_copy():
    cache = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 16), jnp.bfloat16)  # rows of 2 x 16 x 2 = 64 bytes
    new = jnp.zeros((3, KV_HEADS, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128 bytes.*are 64.*impl='reference'"):
        write_kv(cache, cache, new, new, jnp.zeros(3, jnp.int32), impl="mosaic_gpu")


def test_unknown_impl_is_refused():
    k_cache, v_cache, k_new, v_new, slots = _random_case(6, 4, np.float32, np.float32)
    with pytest.raises(ValueError, match="unknown KV write impl"):
        write_kv(*map(jnp.asarray, (k_cache, v_cache, k_new, v_new, slots)), impl="triton")


@pytest.mark.gpu
def test_kernel_writes_in_place_at_llama3_sizes():
    """On the GPU: Llama-3-8B's KV heads in bf16, a decode-sized and a prefill-sized step, equal to XLA's
    scatter; the donated caches alias the outputs and nothing cache-sized is allocated."""
    rng = np.random.default_rng(7)
    shape = (2048, 16, 8, 128)
    memory, cache, new = _donated_write_memory("mosaic_gpu", shape, 64, jnp.bfloat16)
    assert memory.alias_size_in_bytes == 2 * cache.size * 2
    assert memory.temp_size_in_bytes < new.size * 2
    for num_tokens in (64, 8192):
        k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
        k_new, v_new = (jnp.asarray(rng.standard_normal((num_tokens, 8, 128)), jnp.bfloat16) for _ in range(2))
        slots = rng.permutation(shape[0] * shape[1])[:num_tokens].astype(np.int32)
        slots[rng.random(num_tokens) < 0.1] = -1
        args = (k_new, v_new, jnp.asarray(slots))
        expected = write_kv(k_cache, v_cache, *args, impl="reference")
        step = jax.jit(functools.partial(write_kv, impl="mosaic_gpu"), donate_argnums=(0, 1))
        for got, want in zip(step(k_cache, v_cache, *args), expected):
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_automatic_choice_takes_the_kernel_for_large_writes_on_hopper():
    from jaxrunner.ops.attention_backend import KV_WRITE_KERNEL_MIN_TOKENS, AttentionBackend

    bf16_cache = jnp.zeros((4, 16, 8, 128), jnp.bfloat16)  # 2 KiB rows
    narrow_cache = jnp.zeros((4, 16, 1, 32), jnp.bfloat16)  # 64-byte rows: the kernel cannot copy them
    many, few = KV_WRITE_KERNEL_MIN_TOKENS, KV_WRITE_KERNEL_MIN_TOKENS - 1
    this_cpu = AttentionBackend.for_devices(jax.devices())
    assert this_cpu.kv_write_impl(many, bf16_cache) == "reference"  # this CPU is no Hopper GPU
    assert AttentionBackend.for_devices(jax.devices(), "mosaic_gpu").kv_write_impl(few, bf16_cache) == "mosaic_gpu"
    hopper = AttentionBackend(hopper=True)
    assert hopper.kv_write_impl(many, bf16_cache) == "mosaic_gpu"
    assert hopper.kv_write_impl(few, bf16_cache) == "reference"
    assert hopper.kv_write_impl(many, narrow_cache) == "reference"
    assert AttentionBackend("reference", hopper=True).kv_write_impl(many, narrow_cache) == "reference"
