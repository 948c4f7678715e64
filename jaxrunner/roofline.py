"""The device's copy and matmul rates, and the floor they put under a step.

A step reads every weight and every scheduled request's KV tokens at least
once, and multiplies each of its tokens by every weight matrix, so its time is
at least the slower of those bytes at the rate the device copies memory and
those FLOPs at the rate it multiplies matrices (the roofline). ``jaxrunner
bench`` bounds a run with it, step by step (the engine's ``StepWork``, ``step_floor_s``), and
the benchmarks bound their steps with the same rates.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jaxrunner.engine.llm_engine import StepWork
    from jaxrunner.runner.model_runner import ModelRunner


def median_seconds(fn: Callable[[], jax.Array], repeats: int) -> float:
    """Median wall seconds of ``fn()`` to its result, after one call that compiles it."""
    fn().block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bytes_per_s(elements: int, chained_calls: int = 10) -> float:
    """The default device's copy rate: bytes read and written per second by a jitted ``x * 2``
    over ``elements`` random bf16 values, ``chained_calls`` of it back to back (so that one
    dispatch and one wait do not count as copying), the median of 10 such runs."""
    x = jax.random.normal(jax.random.key(0), (elements,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2)

    def chained() -> jax.Array:
        y = x
        for _ in range(chained_calls):
            y = double(y)
        return y

    return chained_calls * 2 * x.nbytes / median_seconds(chained, 10)


def matmul_flops_per_s(n: int, dtype=jnp.bfloat16) -> float:
    """The default device's rate on a square ``n`` product of random ``dtype`` values accumulated in float32,
    both operands with the contraction axis minor (``a @ bᵀ``: the layout FP8 GEMMs read)."""
    key = jax.random.key(2)
    a, b = (jax.random.normal(k, (n, n), jnp.float32).astype(dtype) for k in jax.random.split(key))
    product = jax.jit(
        lambda p, q: jax.lax.dot_general(p, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    )
    return 2 * n**3 / median_seconds(lambda: product(a, b), 10)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What a model's step costs one device, per unit of ``StepWork``. The FLOPs are undercounts where the
    exact figure depends on more than the work (so that they stay a floor); the bytes count every weight and
    every KV token, which overstates a mixture's step (experts no token routes to) and a sliding-window
    model's (keys past the window)."""

    weight_bytes: int
    """The device's share of the weights, read once a forward pass."""
    matmul_params: float
    """Weight matrix parameters every token is multiplied by: the decoder's matrices (not the embedding table or
    the LM head, which multiplies only the rows sampled), the experts of a mixture counted at
    ``top_k / num_experts``; the device's share."""
    kv_bytes_per_token: float
    """KV bytes of one token over all layers, the device's share."""
    flops_per_pair: int
    """Attention FLOPs of one (query, key) pair (``Q Kᵀ`` and ``P V``) over the full-attention layers (a
    sliding-window layer's pairs are fewer: not counted), the device's share."""


def step_costs(runner: ModelRunner) -> StepCosts:
    """``runner``'s model's ``StepCosts`` on its first device."""
    from jaxrunner.sharding import tensor_parallel_size

    arch, device = runner.model_arch, runner.mesh.local_devices[0]
    tp = tensor_parallel_size(runner.mesh)
    params = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.params)[0]:
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or "embed_tokens" in name or "lm_head" in name:
            continue
        params += leaf.size * (arch.moe.top_k / arch.moe.num_experts if arch.moe and "experts" in name else 1)
    kv_spec = runner.kv_cache_spec.per_device(tp)
    full_layers = sum(arch.layer_sliding_window(i) is None for i in range(arch.num_layers))
    return StepCosts(
        weight_bytes=bytes_on_device(runner.params, device),
        matmul_params=params / tp,
        kv_bytes_per_token=kv_spec.bytes_per_block / kv_spec.block_size,
        flops_per_pair=4 * full_layers * arch.num_heads * arch.head_dim // tp,
    )


def step_floor_s(work: StepWork, costs: StepCosts, copy_bytes_per_s: float, matmul_flops_per_s: float) -> float:
    """The least time ``work`` takes on one device: its bytes at the copy rate or its FLOPs at the matmul rate,
    whichever is slower."""
    read = work.forward_passes * costs.weight_bytes + work.kv_tokens_read * costs.kv_bytes_per_token
    flops = 2 * work.tokens * costs.matmul_params + work.attention_pairs * costs.flops_per_pair
    return max(read / copy_bytes_per_s, flops / matmul_flops_per_s)


# jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
def bytes_on_device(tree, device: jax.Device) -> int:  # pyright: ignore[reportInvalidTypeForm]
    """Bytes of the shards of ``tree``'s arrays that ``device`` holds."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )
