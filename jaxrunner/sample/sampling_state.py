"""Per-request sampling parameters, kept on the device and written when requests join."""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from jaxrunner.interfaces import SamplingParams
from jaxrunner.sample.gumbel import split_seed

# Int32 words a new request's sampling parameters take in the packed row.
NUM_SAMPLING_WORDS = 5


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """One slot per request; greedy rows have temperature 0."""

    temperature: Float[Array, "max_reqs"]
    top_k: Int[Array, "max_reqs"]
    top_p: Float[Array, "max_reqs"]
    seed_lo: UInt32[Array, "max_reqs"]
    seed_hi: UInt32[Array, "max_reqs"]

    @classmethod
    def zeros(cls, max_num_reqs: int) -> SamplingArrays:
        return cls(
            temperature=jnp.zeros(max_num_reqs, jnp.float32),
            top_k=jnp.zeros(max_num_reqs, jnp.int32),
            top_p=jnp.ones(max_num_reqs, jnp.float32),
            seed_lo=jnp.zeros(max_num_reqs, jnp.uint32),
            seed_hi=jnp.zeros(max_num_reqs, jnp.uint32),
        )

    def write_rows(self, slots: Int[Array, "n"], words: Int[Array, "n 5"]) -> SamplingArrays:
        """Scatter packed parameter words into ``slots`` (out-of-range slots are dropped)."""
        as_float = jax.lax.bitcast_convert_type(words, jnp.float32)
        as_uint = jax.lax.bitcast_convert_type(words, jnp.uint32)
        return SamplingArrays(
            temperature=self.temperature.at[slots].set(as_float[:, 0], mode="drop"),
            top_k=self.top_k.at[slots].set(words[:, 1], mode="drop"),
            top_p=self.top_p.at[slots].set(as_float[:, 2], mode="drop"),
            seed_lo=self.seed_lo.at[slots].set(as_uint[:, 3], mode="drop"),
            seed_hi=self.seed_hi.at[slots].set(as_uint[:, 4], mode="drop"),
        )


def pack_sampling_params(params: SamplingParams, rng: random.Random) -> np.ndarray:
    """The int32 words of one request's parameters; an unseeded request gets a random seed."""
    seed = params.seed if params.seed is not None else rng.getrandbits(64)
    lo, hi = split_seed(seed)
    temperature = 0.0 if params.greedy else params.temperature
    top_k = 0 if params.greedy else params.top_k
    top_p = 1.0 if params.greedy else params.top_p
    floats = np.array([temperature, top_p], np.float32).view(np.int32)
    return np.array(
        [floats[0], top_k, floats[1], np.uint32(lo).view(np.int32), np.uint32(hi).view(np.int32)],
        np.int32,
    )
