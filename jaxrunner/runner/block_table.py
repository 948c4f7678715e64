"""Block tables: which KV blocks each request owns, and the slot of every token.

The table lives on the device, one row per request slot. A new request's row
is written whole with the request; blocks appended later travel as
(row, column, block id) triples inside the step's packed input buffer. With
several KV-cache groups the row holds each group's blocks in its own run of
``max_blocks`` columns, one group after another.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int


class BlockTables:
    """Host side of the block table: how many blocks each slot holds, staged appends."""

    def __init__(self, max_num_reqs: int, max_blocks: int, block_size: int, num_groups: int = 1):
        self.max_num_reqs = max_num_reqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.num_groups = num_groups
        self.num_blocks = np.zeros((max_num_reqs, num_groups), np.int32)
        self._staged: list[tuple[int, int, int]] = []

    def append_block_ids(self, slot: int, block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        """Record each group's ``block_ids`` for ``slot``; only appends are staged (a new row travels whole)."""
        for group, ids in enumerate(block_ids):
            start = 0 if overwrite else int(self.num_blocks[slot, group])
            end = start + len(ids)
            if end > self.max_blocks:
                raise ValueError(
                    f"Request slot {slot} would hold {end} KV blocks, more than the {self.max_blocks} "
                    "that max_model_len allows."
                )
            if not overwrite:
                column = group * self.max_blocks + start
                self._staged.extend((slot, column + i, b) for i, b in enumerate(ids))
            self.num_blocks[slot, group] = end

    def clear(self, slot: int) -> None:
        """Forget the slot's blocks (its request finished or was preempted)."""
        self.num_blocks[slot] = 0

    def reset(self) -> None:
        """No slot holding blocks and no append staged: the runner dropped all its requests."""
        self.num_blocks[:] = 0
        self._staged = []

    @staticmethod
    def append_capacity(num_tokens: int, num_reqs: int, block_size: int, num_groups: int = 1) -> int:
        """Most blocks a step of ``num_tokens`` tokens over ``num_reqs`` requests can append, over
        ``num_groups`` KV-cache groups."""
        return (num_tokens // block_size + num_reqs + 1) * num_groups

    def take_staged(self, capacity: int) -> np.ndarray:
        """The staged appends as int32 ``[3, capacity]`` (row, column, block id), padding row -1."""
        if len(self._staged) > capacity:
            raise RuntimeError(
                f"{len(self._staged)} block appends in one step exceed the step's capacity "
                f"({capacity}); the scheduler allocated more blocks than the scheduled tokens need."
            )
        triples = np.full((3, capacity), -1, np.int32)
        if self._staged:
            triples[:, : len(self._staged)] = np.array(self._staged, np.int32).T
        self._staged = []
        return triples


def apply_block_appends(
    block_table: Int[Array, "max_reqs max_blocks_per_req"], triples: Int[Array, "3 capacity"]
) -> Int[Array, "max_reqs max_blocks_per_req"]:
    """Write appended block ids; padding triples (row -1) are dropped."""
    rows = jnp.where(triples[0] < 0, block_table.shape[0], triples[0])
    return block_table.at[rows, triples[1]].set(triples[2], mode="drop")


def group_columns(
    block_table: Int[Array, "max_reqs table_width"], group: int, num_groups: int
) -> Int[Array, "max_reqs max_blocks_per_req"]:
    """``group``'s run of columns in a table of ``num_groups`` groups."""
    width = block_table.shape[1] // num_groups
    return block_table[:, group * width : (group + 1) * width]


def compute_slot_mapping(
    block_table: Int[Array, "max_reqs max_blocks_per_req"],
    token_req_slots: Int[Array, " num_tokens"],
    positions: Int[Array, " num_tokens"],
    is_real: Bool[Array, " num_tokens"],
    block_size: int,
) -> Int[Array, " num_tokens"]:
    """``block_table[req, p // block_size] * block_size + p % block_size``; -1 for padding."""
    block_idx = jnp.clip(positions // block_size, 0, block_table.shape[1] - 1)
    block_ids = block_table.at[token_req_slots, block_idx].get(mode="fill", fill_value=0)
    slots = block_ids * block_size + positions % block_size
    return jnp.where(is_real, slots, -1)
