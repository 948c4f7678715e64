"""Test configuration: float32 matmuls on the CPU, runtime type checks, GPU tests only where a GPU is.

The CPU backend is split into eight devices before JAX starts, for the
tensor- and data-parallel tests; every other test runs on the first device.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"])
)

import jaxtyping

# Every annotation in jaxrunner (jaxrunner.models and jaxrunner.ops included) is checked at call time,
# jaxtyping's shapes consistent across the arguments of one call; runtime_checks.py has the checker.
# Installed before anything imports jaxrunner.
jaxtyping.install_import_hook("jaxrunner", "runtime_checks.typechecker")

import jax  # noqa: E402  (after XLA_FLAGS and the hook)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    # beartype's advice on typing.Hashable and typing.MutableSequence, hints in Flax's own types.
    config.addinivalue_line("filterwarnings", "ignore::beartype.roar.BeartypeDecorHintPep585DeprecationWarning")


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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A persistent compilation cache shared by one test module's engines and runners."""
    return str(tmp_path_factory.mktemp("xla_cache"))
