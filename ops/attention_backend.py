"""Which implementation the attention and KV-write ops trace: chosen once for a set of devices.

A runner resolves its ``AttentionBackend`` from its mesh's devices and
``$JAXRUNNER_ATTENTION_IMPL`` when it builds its programs, and the model hands
it to every layer; what remains to decide at trace time depends on static
shapes and dtypes only (whether a kernel supports them, and pays off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array

from jaxrunner import envs
from jaxrunner.compat import is_hopper, mosaic_gpu_interpreter
from jaxrunner.ops import attention_mgpu, kv_write_mgpu

IMPLEMENTATIONS = ("reference", "mosaic_gpu")
"""The implementations an ``AttentionBackend`` (or ``$JAXRUNNER_ATTENTION_IMPL``) can force."""

KV_WRITE_KERNEL_MIN_TOKENS = 1024
"""Fewest tokens for which the automatic choice writes the KV cache with the kernel rather than XLA's
scatter: it wins clearly only at prefill-sized writes (``benchmarks/decisions/kv_write_threshold.md``)."""


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The attention ops' implementation for one set of devices.

    ``impl`` forces one of :data:`IMPLEMENTATIONS` for every shape; None takes the
    Mosaic GPU kernels on Hopper where they support the shape, the pure-JAX
    reference elsewhere. ``interpret``: the devices are no GPU, so a forced kernel
    runs through the Mosaic GPU interpreter (slow: for tests).
    """

    impl: str | None = None
    hopper: bool = False
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.impl not in (None, *IMPLEMENTATIONS):
            raise ValueError(
                f"unknown attention impl {self.impl!r} (argument or ${envs.ATTENTION_IMPL_ENV_VAR}); "
                f"valid: None, {', '.join(map(repr, IMPLEMENTATIONS))}"
            )

    @classmethod
    # jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
    def for_devices(cls, devices: Sequence[jax.Device], impl: str | None = None) -> AttentionBackend:  # pyright: ignore[reportInvalidTypeForm]
        """The backend of ``devices`` (alike, as a mesh's are): ``impl`` if given, else the flag's, else automatic."""
        device = devices[0]
        return cls(impl or envs.JAXRUNNER_ATTENTION_IMPL, is_hopper(device), device.platform != "gpu")

    @classmethod
    def default(cls, impl: str | None = None) -> AttentionBackend:
        """The backend of JAX's default devices: for callers of the ops that resolved none."""
        return cls.for_devices(jax.devices(), impl)

    def attention_impl(self, q: Array, k_cache: Array) -> str:
        """The attention implementation for these shapes: the forced one, else the kernel where it applies
        (to the queries' dtype and the cache's, which differ for an FP8 cache)."""
        if self.impl is not None:
            return self.impl
        head_dim, block_size = q.shape[-1], k_cache.shape[1]
        fits = attention_mgpu.kernel_supports(q.dtype, head_dim, block_size, k_cache.dtype)
        return "mosaic_gpu" if self.hopper and fits else "reference"

    def check_kv_cache_dtype(self, kv_dtype: DTypeLike, model_dtype: DTypeLike, head_dim: int, block_size: int) -> None:
        """Refuse, at start, a cache dtype other than the model's (an FP8 cache) that the forced kernel cannot read.

        With the impl left automatic such a cache falls back to the reference; a
        forced "mosaic_gpu" would fail inside the kernel at the first trace instead.
        """
        if self.impl != "mosaic_gpu" or jnp.dtype(kv_dtype) == jnp.dtype(model_dtype):
            return
        if attention_mgpu.kernel_supports(model_dtype, head_dim, block_size, kv_dtype):
            return
        candidates = (*attention_mgpu.QUERY_DTYPES, *attention_mgpu.FP8_CACHE_DTYPES)
        takes = [
            dtype.name
            for dtype in candidates
            if attention_mgpu.kernel_supports(model_dtype, head_dim, block_size, dtype)
        ]
        raise ValueError(
            f"The Mosaic GPU attention kernel (attention impl 'mosaic_gpu', argument or "
            f"${envs.ATTENTION_IMPL_ENV_VAR}) cannot read a {jnp.dtype(kv_dtype).name} KV cache with head_dim "
            f"{head_dim} and block_size {block_size}; for these it takes {', '.join(takes) or 'no cache dtype'}. "
            "Choose one of those (CacheConfig.cache_dtype / kv_cache_dtype), or the 'reference' attention impl."
        )

    def kv_write_impl(self, num_tokens: int, k_cache: Array) -> str:
        """The KV-write implementation: the forced one, else the kernel for large writes whose rows it can copy."""
        if self.impl is not None:
            return self.impl
        large = num_tokens >= KV_WRITE_KERNEL_MIN_TOKENS
        return "mosaic_gpu" if self.hopper and large and kv_write_mgpu.kernel_supports(k_cache) else "reference"

    def interpreter(self):
        """A Mosaic GPU kernel's ``interpret`` argument: None on a GPU (compiled), else the interpreter's."""
        return mosaic_gpu_interpreter() if self.interpret else None
