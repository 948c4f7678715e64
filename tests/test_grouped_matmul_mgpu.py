"""The Mosaic GPU grouped matmul against XLA's ``ragged_dot`` (the reference): through the Mosaic GPU
interpreter on the CPU at small sizes, compiled at a mixture-of-experts layer's sizes on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.compat import mosaic_gpu_interpreter
from jaxrunner.ops.grouped_matmul import grouped_matmul
from jaxrunner.ops.grouped_matmul_mgpu import (
    NUM_ROWS,
    ROW_START,
    GroupedMatmulConfig,
    grouped_matmul_mgpu,
    num_tiles_bound,
    tile_schedule,
)


def _inputs(sizes, in_features: int, out_features: int, seed: int):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((int(sum(sizes)), in_features)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), in_features, out_features)) * 0.1, jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _max_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("sizes", [[3, 0, 70, 1, 0, 6], [0, 0, 130, 0], [1, 1, 1, 1, 1]])
def test_tile_schedule_covers_every_row_once_in_tiles_of_one_group(sizes):
    block_m = 64
    fields = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), sum(sizes), block_m))
    assert fields.shape[0] == num_tiles_bound(sum(sizes), len(sizes), block_m)
    starts = np.cumsum(sizes) - sizes
    covered = []
    for group, row_start, num_rows in fields[fields[:, NUM_ROWS] > 0]:
        assert 0 < num_rows <= block_m
        assert starts[group] <= row_start and row_start + num_rows <= starts[group] + sizes[group]
        covered.extend(range(row_start, row_start + num_rows))
    assert covered == list(range(sum(sizes)))  # in order, none twice, none left out
    assert (fields[fields[:, NUM_ROWS] == 0, ROW_START] >= 0).all()


@pytest.mark.parametrize(
    "sizes, config",
    [
        # Groups of 0, 1, a few and more than one tile of rows; a 2-deep ring of two stages' refills.
        ([3, 0, 70, 1, 0, 6], GroupedMatmulConfig(block_n=128, num_stages=2)),
        # One row a group (decode: a token's experts), every group's stages in flight at once.
        ([1, 1, 0, 1, 1], GroupedMatmulConfig(block_n=64, num_stages=4)),
    ],
    ids=["mixed", "one-row-groups"],
)
def test_interpreted_kernel_matches_reference(sizes, config):
    lhs, rhs, group_sizes = _inputs(sizes, 256, 256, seed=0)
    kernel = jax.jit(lambda a, b, s: grouped_matmul_mgpu(a, b, s, config=config, interpret=mosaic_gpu_interpreter()))
    assert _max_error(kernel(lhs, rhs, group_sizes), grouped_matmul(lhs, rhs, group_sizes)) < 1e-2


def test_kernel_refuses_widths_its_blocks_do_not_divide():
    lhs, rhs, group_sizes = _inputs([2, 3], 96, 128, seed=1)
    with pytest.raises(ValueError, match="multiples of block_k 64"):
        grouped_matmul_mgpu(lhs, rhs, group_sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 512])
@pytest.mark.parametrize("in_features, out_features", [(2048, 1536), (768, 2048)], ids=["gate_up", "down"])
def test_compiled_kernel_matches_reference(tokens, in_features, out_features):
    """Qwen3-30B-A3B's expert products (128 experts, 8 a token) under random routing."""
    rng = np.random.default_rng(tokens)
    experts = np.stack([rng.choice(128, 8, replace=False) for _ in range(tokens)])
    sizes = np.bincount(experts.reshape(-1), minlength=128)
    lhs, rhs, group_sizes = _inputs(sizes, in_features, out_features, seed=tokens)
    got = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, impl="mgpu"))(lhs, rhs, group_sizes)
    assert _max_error(got, grouped_matmul(lhs, rhs, group_sizes)) < 1e-2
