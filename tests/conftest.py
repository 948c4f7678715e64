"""Test configuration: float32 matmuls on the CPU, GPU tests only where a GPU is."""

import jax
import pytest

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
