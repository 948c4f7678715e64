"""The grouped matmul of mixture-of-experts layers: rows sorted by group, each group times its own matrix.

``lhs`` rows are sorted so that group ``g``'s ``group_sizes[g]`` rows are
contiguous, in group order; the result's rows are ``lhs``'s, each multiplied by its
group's ``rhs[g]``. Only the rows each group has are multiplied: no dense product
over every (row, group) pair and no padding of every group to the largest.

Two implementations: ``"reference"``, XLA's ``ragged_dot`` (the test oracle, and
the CPU's), and ``"mgpu"``, the Mosaic GPU kernel (``grouped_matmul_mgpu``) for
Hopper, which reads only the matrices of groups that have rows.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrunner.ops.grouped_matmul_mgpu import grouped_matmul_mgpu

IMPLEMENTATIONS = ("reference", "mgpu")


def grouped_matmul(
    lhs: Float[Array, "num_rows in_features"],
    rhs: Float[Array, "num_groups in_features out_features"],
    group_sizes: Int[Array, " num_groups"],
    *,
    impl: str = "reference",
    interpret=None,
) -> Float[Array, "num_rows out_features"]:
    """``lhs[rows of g] @ rhs[g]`` for every group ``g``, accumulated in float32, in ``lhs``'s dtype.

    ``sum(group_sizes)`` must be ``num_rows``. ``interpret`` runs the kernel through the Mosaic GPU
    interpreter (``jaxrunner.compat.mosaic_gpu_interpreter``).
    """
    if impl == "mgpu":
        return grouped_matmul_mgpu(lhs, rhs, group_sizes, interpret=interpret)
    if impl != "reference":
        raise ValueError(f"grouped matmul implementation {impl!r}: pick one of {IMPLEMENTATIONS}")
    out = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
