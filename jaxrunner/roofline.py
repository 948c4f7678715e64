"""The device's copy rate, and the floor it puts under steps that must read their weights and KV cache.

A decode step reads every weight and every scheduled request's KV tokens at
least once, so its time is at least those bytes over the rate at which the
device copies memory. ``jaxrunner bench`` bounds a run that way, and the
benchmarks bound their steps with the same rate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


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


# jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
def bytes_on_device(tree, device: jax.Device) -> int:  # pyright: ignore[reportInvalidTypeForm]
    """Bytes of the shards of ``tree``'s arrays that ``device`` holds."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )
