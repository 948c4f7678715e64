"""Test configuration: float32 matmuls on the CPU, GPU tests only where a GPU is.

The CPU backend is split into eight devices before JAX starts, for the
tensor- and data-parallel tests; every other test runs on the first device.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"])
)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
