"""The connector interface (vLLM's ``KVConnectorBase_V1``, in one object for one process), and the no-op one.

The scheduler side says how many of a request's prompt tokens the store holds
beyond the device's prefix cache (``get_num_new_matched_tokens``), learns the
blocks they are loaded into (``update_state_after_alloc``), and builds each
step's ``KVConnectorMetadata``: the blocks to load before the forward and the
blocks to save after it. The worker side does those copies
(``start_load_kv`` before the forward, ``save_kv`` after it) and completes the
saves in flight (``get_finished``). The runner calls the worker side around
every forward, as the runner we mirror calls ``pre_forward`` / ``post_forward``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax

from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.kv_connector.block_stores import BlockData


@runtime_checkable
class ConnectorRequest(Protocol):
    """What the scheduler side reads of a request (the engine's ``Request``)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int

    @property
    def block_hash_ids(self) -> Sequence[int | str]: ...

    @property
    def lora_name(self) -> str | None: ...


@runtime_checkable
class BlockMover(Protocol):
    """The runner's two block programs, bucketed (``jaxrunner.runner.kv_connector.mover``)."""

    def gather(self, kv_caches: KVCaches, block_ids: list[int]) -> list[tuple[jax.Array, jax.Array]]:
        """Each block's K and V, ``[num_layers, block_size, num_kv_heads, head_dim]``, their copies to the host
        already started."""
        ...

    def scatter(self, kv_caches: KVCaches, block_ids: list[int], blocks: list[BlockData]) -> KVCaches: ...


@dataclasses.dataclass
class KVConnectorMetadata:
    """One step's copies: blocks to load into the cache (with their data), blocks to save (with their keys)."""

    load_block_ids: list[int] = dataclasses.field(default_factory=list)
    load_blocks: list[BlockData] = dataclasses.field(default_factory=list)
    save_block_ids: list[int] = dataclasses.field(default_factory=list)
    save_keys: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KVConnectorStats:
    """What a connector moved and what failed (each failure fell back to computing the tokens)."""

    loaded_tokens: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_failures: int = 0
    save_failures: int = 0


class KVConnectorBase:
    """A connector that moves nothing: the default, whose calls cost nothing."""

    def __init__(self) -> None:
        self.stats = KVConnectorStats()

    # ------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the store can load, and whether they load asynchronously."""
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's blocks once allocated: the external tokens load into them."""

    def build_connector_meta(
        self, requests: Sequence[ConnectorRequest], block_ids: dict[str, list[int]]
    ) -> KVConnectorMetadata | None:
        """The step's copies, given its scheduled requests and their blocks."""
        return None

    def request_finished(self, request: ConnectorRequest) -> bool:
        """Forget the request; True if its blocks must stay until saves complete (never here)."""
        return False

    # ---------------------------------------------------------------- worker

    def start_load_kv(self, metadata: KVConnectorMetadata | None, kv_caches: KVCaches, mover: BlockMover) -> KVCaches:
        """Load the step's blocks into the caches, before its forward."""
        return kv_caches

    def save_kv(self, metadata: KVConnectorMetadata | None, kv_caches: KVCaches, mover: BlockMover) -> None:
        """Start saving the step's blocks, after its forward."""

    def get_finished(self, flush: bool = False) -> None:
        """Complete the saves whose copies have had time to arrive (with ``flush``, all of them)."""
