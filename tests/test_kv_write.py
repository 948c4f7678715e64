"""write_kv against a NumPy loop: random slots with padding (-1), dtype casts, donation.

Both implementations: XLA's scatter ("reference") and the Mosaic GPU kernel
("mosaic_gpu"), which off a GPU runs through the Mosaic GPU interpreter.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrunner.ops import write_kv

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 12, 8, 2, 16
IMPLS = ["reference", "mosaic_gpu"]


def _random_case(seed: int, num_tokens: int, cache_dtype, new_dtype):
    """Random caches, new K/V and distinct slots, about a quarter of them -1."""
    rng = np.random.default_rng(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (rng.standard_normal(shape).astype(cache_dtype) for _ in range(2))
    k_new, v_new = (rng.standard_normal((num_tokens, KV_HEADS, HEAD_DIM)).astype(new_dtype) for _ in range(2))
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < 0.25] = -1
    slots[-1] = -1
    return k_cache, v_cache, k_new, v_new, slots


def _numpy_write(cache: np.ndarray, new: np.ndarray, slots: np.ndarray) -> np.ndarray:
    out = cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = new[t].astype(cache.dtype)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed, num_tokens", [(0, 40), (1, 1), (2, 15), (3, 17)])
def test_write_kv_matches_numpy_loop(seed, num_tokens, impl):
    k_cache, v_cache, k_new, v_new, slots = _random_case(seed, num_tokens, np.float32, np.float32)
    if num_tokens > 1:
        slots[0] = NUM_BLOCKS * BLOCK_SIZE - 1  # the last slot of the cache
    k_out, v_out = write_kv(*map(jnp.asarray, (k_cache, v_cache, k_new, v_new, slots)), impl=impl)
    np.testing.assert_array_equal(np.asarray(k_out), _numpy_write(k_cache, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _numpy_write(v_cache, v_new, slots))


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_slots_leave_cache_untouched(impl):
    k_cache, v_cache, k_new, v_new, slots = _random_case(3, 16, np.float32, np.float32)
    slots[:] = -1
    k_out, v_out = write_kv(*map(jnp.asarray, (k_cache, v_cache, k_new, v_new, slots)), impl=impl)
    np.testing.assert_array_equal(np.asarray(k_out), k_cache)
    np.testing.assert_array_equal(np.asarray(v_out), v_cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_values_cast_into_bf16_cache(impl):
    k_cache, v_cache, k_new, v_new, slots = _random_case(4, 40, ml_dtypes.bfloat16, np.float32)
    k_out, v_out = write_kv(*map(jnp.asarray, (k_cache, v_cache, k_new, v_new, slots)), impl=impl)
    assert k_out.dtype == v_out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(k_out), _numpy_write(k_cache, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _numpy_write(v_cache, v_new, slots))


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_with_donated_caches(impl):
    k_cache, v_cache, k_new, v_new, slots = _random_case(5, 24, np.float32, np.float32)
    step = jax.jit(functools.partial(write_kv, impl=impl), donate_argnums=(0, 1))
    k_dev, v_dev = jnp.asarray(k_cache), jnp.asarray(v_cache)
    k_out, v_out = step(k_dev, v_dev, *map(jnp.asarray, (k_new, v_new, slots)))
    np.testing.assert_array_equal(np.asarray(k_out), _numpy_write(k_cache, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _numpy_write(v_cache, v_new, slots))
    assert k_dev.is_deleted() and v_dev.is_deleted()


def test_donated_write_needs_no_cache_sized_buffer():
    """In place: the compiled step allocates nothing the size of a cache.

    float32 only: the CPU backend widens bf16 scatters to float32, a copy GPUs do not make.
    """
    cache = jax.ShapeDtypeStruct((64, 16, 8, 128), jnp.float32)
    new = jax.ShapeDtypeStruct((32, 8, 128), jnp.float32)
    slots = jax.ShapeDtypeStruct((32,), jnp.int32)
    compiled = jax.jit(write_kv, donate_argnums=(0, 1)).lower(cache, cache, new, new, slots).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < new.size * 4


def test_unknown_impl_is_refused():
    k_cache, v_cache, k_new, v_new, slots = _random_case(6, 4, np.float32, np.float32)
    with pytest.raises(ValueError, match="unknown KV write impl"):
        write_kv(*map(jnp.asarray, (k_cache, v_cache, k_new, v_new, slots)), impl="triton")


@pytest.mark.gpu
def test_kernel_writes_in_place_at_llama3_sizes():
    """On the GPU: Llama-3-8B's KV heads, bf16, a decode-sized and a prefill-sized step; equal to XLA's
    scatter, and the donated compiled write allocates nothing the size of a cache."""
    rng = np.random.default_rng(7)
    shape = (2048, 16, 8, 128)
    for num_tokens in (64, 8192):
        k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
        k_new, v_new = (jnp.asarray(rng.standard_normal((num_tokens, 8, 128)), jnp.bfloat16) for _ in range(2))
        slots = rng.permutation(shape[0] * shape[1])[:num_tokens].astype(np.int32)
        slots[rng.random(num_tokens) < 0.1] = -1
        args = (k_new, v_new, jnp.asarray(slots))
        expected = write_kv(k_cache, v_cache, *args, impl="reference")
        step = jax.jit(functools.partial(write_kv, impl="mosaic_gpu"), donate_argnums=(0, 1))
        compiled = step.lower(k_cache, v_cache, *args).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < k_new.size * k_new.dtype.itemsize
        got = step(k_cache, v_cache, *args)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(e.astype(jnp.float32)))
