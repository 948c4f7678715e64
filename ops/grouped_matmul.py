"""The grouped matmul of mixture-of-experts layers: rows sorted by group, each group times its own matrix.

``lhs`` rows are sorted so that group ``g``'s ``group_sizes[g]`` rows are
contiguous, in group order; the result's rows are ``lhs``'s, each multiplied by its
group's ``rhs[g]``. Only the rows each group has are multiplied: no dense product
over every (row, group) pair and no padding of every group to the largest.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def grouped_matmul(
    lhs: Float[Array, "num_rows in_features"],
    rhs: Float[Array, "num_groups in_features out_features"],
    group_sizes: Int[Array, " num_groups"],
) -> Float[Array, "num_rows out_features"]:
    """``lhs[rows of g] @ rhs[g]`` for every group ``g``, accumulated in float32, in ``lhs``'s dtype.

    ``sum(group_sizes)`` must be ``num_rows``. The reference is XLA's ``ragged_dot``.
    """
    out = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
