"""Test configuration: float32 matmuls on the CPU, runtime type checks, GPU tests only where a GPU is.

The CPU backend is split into eight devices before JAX starts, for the
tensor- and data-parallel tests; every other test runs on the first device.
"""

import os
from collections import Counter

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


# Test files whose few tests take minutes each (engines compiled end to end, notebooks executed), slowest
# first. The README's command hands whole files to two workers in the order collected here (xdist's own
# reorder, by number of tests, is off): these first, then the rest by number of tests, so that neither
# worker is left running one of them alone at the end.
SLOW_FILES = (
    "test_notebooks.py",
    "test_spec_decode.py",
    "test_engine.py",
    "test_eagle_acceptance.py",
    "test_converted.py",
    "test_spec_decode_async.py",
)


def _slowest_files_first(items: list) -> None:
    tests_in = Counter(item.path.name for item in items)

    def file_rank(item) -> tuple:
        name = item.path.name
        known = SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)
        return (known, -tests_in[name], name)

    items.sort(key=file_rank)  # stable: each file's tests keep their order


def pytest_collection_modifyitems(config, items):
    _slowest_files_first(items)
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
