"""The suite's runtime type checks are on: jaxtyping's import hook instruments jaxrunner, including the
packages installed from the top-level ``models/`` and ``ops/`` folders (``conftest.py``)."""

import jax
import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

from jaxrunner.interfaces import SamplingParams
from jaxrunner.models.transformer import apply_rope
from jaxrunner.ops import AttentionMetadata
from jaxrunner.sample.logits_processors import apply_min_p


def _metadata(num_reqs: int, num_tokens: int) -> AttentionMetadata:
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
    return AttentionMetadata(i32(num_reqs + 1), i32(num_reqs), i32(num_reqs, 4), i32(num_tokens))


def test_models_shapes_are_checked():
    x, angles = jnp.zeros((4, 2, 8)), jnp.zeros((4, 4))
    assert apply_rope(x, angles, angles).shape == x.shape
    with pytest.raises(TypeCheckError):
        apply_rope(x, angles, angles[:3])  # num_tokens differs


def test_ops_dataclass_fields_are_checked():
    _metadata(num_reqs=2, num_tokens=5)
    with pytest.raises(TypeCheckError):  # seq_lens and block_tables disagree on num_reqs
        AttentionMetadata(
            jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((3, 4), jnp.int32), jnp.zeros(5, jnp.int32)
        )


def test_sample_dtypes_are_checked():
    logits = jnp.zeros((2, 16))
    assert apply_min_p(logits, jnp.zeros(2)).shape == logits.shape
    with pytest.raises(TypeCheckError):
        apply_min_p(logits, jnp.zeros(2, jnp.int32))  # min_p is float


def test_jax_rebuilds_pytree_dataclasses_unchecked():
    """JAX's own rebuilds with placeholder leaves pass; an int passes for a float, as for pyright."""
    abstract = jax.eval_shape(lambda: _metadata(num_reqs=2, num_tokens=5))
    assert abstract.slot_mapping.shape == (5,)
    assert SamplingParams(temperature=0).greedy
