"""Connectors over a ``BlockStore``: vLLM's offloading connector (host memory) and shared-storage connector
(files, between a prefill engine and a decode engine).

Saving: every full block a request has computed (prompt or output, once its
tokens are known on the host) is gathered after the step that computed it and
copied to the host in the background; the copy is stored when it has arrived,
at the start of a later step. With ``tails`` (shared storage), a producer also
saves each prompt's last, partial block once its prefill is done, so a consumer
can load all of a prompt but its last token. Loading: a request's blocks past
the device's prefix cache that the store holds, in order, are read on the host
when the request is scheduled (a block that does not read back whole ends the
run: its tokens and the rest are computed, and the failure is counted and
logged), and copied into the request's new blocks before the step's forward.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax

from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.kv_connector.base import BlockMover, ConnectorRequest, KVConnectorBase, KVConnectorMetadata
from jaxrunner.runner.kv_connector.block_stores import (
    BlockData,
    BlockStore,
    CorruptBlock,
    chain_keys,
    landed,
    root_key,
    tail_key,
)

logger = logging.getLogger(__name__)

ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclasses.dataclass
class _RequestState:
    """What the connector tracks of a request: its full blocks' keys, how many it saved, its tail saved, and
    the blocks read for it at scheduling (index, data), loaded once its blocks are allocated."""

    keys: list[str] = dataclasses.field(default_factory=list)
    num_saved: int = 0
    tail_saved: bool = False
    matched: list[tuple[int, BlockData]] = dataclasses.field(default_factory=list)


class BlockStoreConnector(KVConnectorBase):
    """Saves blocks to ``store`` and loads them back, as ``role`` allows; ``tails``: prompts' partial last
    blocks too (a producer saves them, a consumer loads them)."""

    def __init__(self, store: BlockStore, block_size: int, role: str = "kv_both", tails: bool = False):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"KVTransferConfig.kv_role must be one of {', '.join(ROLES)}; got {role!r}.")
        self.store = store
        self.block_size = block_size
        self.loads = role in ("kv_both", "kv_consumer")
        self.saves = role in ("kv_both", "kv_producer")
        self.tails = tails
        self._requests: dict[str, _RequestState] = {}
        self._loads: tuple[list[int], list[BlockData]] = ([], [])
        # Per step: the keys of the blocks it saves, and the blocks on their way to the host.
        self._in_flight: list[tuple[list[str], list[tuple[jax.Array, jax.Array]]]] = []

    def _keys(self, request: ConnectorRequest, count: int) -> list[str]:
        """The keys of the request's first ``count`` full blocks (each computed once)."""
        state = self._requests.setdefault(request.request_id, _RequestState())
        if len(state.keys) < count:
            parent = state.keys[-1] if state.keys else root_key(request.lora_name)
            state.keys += chain_keys(parent, request.block_hash_ids, self.block_size, len(state.keys), count)
        return state.keys[:count]

    def _get(self, key: str) -> BlockData | None:
        """The stored block, or None (missing, or unreadable: counted and logged)."""
        try:
            return self.store.get(key)
        except CorruptBlock as error:
            self.stats.load_failures += 1
            logger.warning("%s; its tokens are computed again.", error)
            return None

    # ------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.loads:
            return 0, False
        ids = request.block_hash_ids
        loadable = len(ids) - 1  # the last token is always computed: its logits are needed
        keys = self._keys(request, len(ids) // self.block_size)  # the last may hold the last token: loaded in part
        state = self._requests[request.request_id]
        state.matched = []
        tokens = num_computed_tokens
        for index in range(num_computed_tokens // self.block_size, len(keys)):
            data = self._get(keys[index])
            if data is None:
                break
            state.matched.append((index, data))
            tokens = (index + 1) * self.block_size
        else:
            whole = len(keys) * self.block_size
            prompt_len = len(request.prompt_token_ids)
            if self.tails and tokens == whole and whole < prompt_len:
                data = self._get(tail_key(keys[-1] if keys else root_key(request.lora_name), ids[whole:prompt_len]))
                if data is not None:
                    state.matched.append((len(keys), data))
                    tokens = loadable
        return max(min(tokens, loadable) - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens > 0:
            for index, data in state.matched:
                self._loads[0].append(block_ids[index])
                self._loads[1].append(data)
            self.stats.loaded_tokens += num_external_tokens
            self.stats.loaded_blocks += len(state.matched)
        state.matched = []

    def build_connector_meta(
        self, requests: Sequence[ConnectorRequest], block_ids: dict[str, list[int]]
    ) -> KVConnectorMetadata | None:
        meta = KVConnectorMetadata(*self._loads)
        self._loads = ([], [])
        if self.saves:
            for request in requests:
                self._add_saves(request, block_ids[request.request_id], meta)
        return meta if meta.load_block_ids or meta.save_block_ids else None

    def _add_saves(self, request: ConnectorRequest, blocks: list[int], meta: KVConnectorMetadata) -> None:
        """The request's full blocks computed by this step (their tokens known), and a producer's prompt tail."""
        ids = request.block_hash_ids
        computed = min(request.num_computed_tokens, len(ids))
        keys = self._keys(request, computed // self.block_size)
        state = self._requests[request.request_id]
        for index in range(state.num_saved, len(keys)):
            if keys[index] not in self.store:
                meta.save_block_ids.append(blocks[index])
                meta.save_keys.append(keys[index])
        state.num_saved = max(state.num_saved, len(keys))
        prompt_len = len(request.prompt_token_ids)
        if self.tails and not state.tail_saved and computed >= prompt_len and prompt_len % self.block_size:
            whole = prompt_len // self.block_size
            parent = keys[whole - 1] if whole else root_key(request.lora_name)
            meta.save_block_ids.append(blocks[whole])
            meta.save_keys.append(tail_key(parent, ids[whole * self.block_size : prompt_len]))
            state.tail_saved = True

    def request_finished(self, request: ConnectorRequest) -> bool:
        self._requests.pop(request.request_id, None)
        return False

    # ---------------------------------------------------------------- worker

    def start_load_kv(self, metadata: KVConnectorMetadata | None, kv_caches: KVCaches, mover: BlockMover) -> KVCaches:
        if metadata is not None and metadata.load_block_ids:
            kv_caches = mover.scatter(kv_caches, metadata.load_block_ids, metadata.load_blocks)
        self.get_finished()  # after the loads: a save that evicts from a full pool never drops a block being loaded
        return kv_caches

    def save_kv(self, metadata: KVConnectorMetadata | None, kv_caches: KVCaches, mover: BlockMover) -> None:
        # One entry a step, empty where it saves nothing, so that get_finished can tell the last step's apart.
        entry: tuple[list[str], list[tuple[jax.Array, jax.Array]]] = ([], [])
        if metadata is not None and metadata.save_block_ids:
            entry = (metadata.save_keys, mover.gather(kv_caches, metadata.save_block_ids))
        self._in_flight.append(entry)

    def get_finished(self, flush: bool = False) -> None:
        """Store the saves of the steps before the last one (their copies to the host had a whole step to
        arrive, so waiting for them does not hold the step up), or with ``flush`` every save in flight."""
        in_flight, self._in_flight = (self._in_flight, []) if flush else (self._in_flight[:-1], self._in_flight[-1:])
        for keys, blocks in in_flight:
            for key, block in zip(keys, blocks, strict=True):
                try:
                    self.store.put(key, landed(block))
                    self.stats.saved_blocks += 1
                except OSError as error:
                    self.stats.save_failures += 1
                    logger.warning("KV block %s could not be saved (%s); it will be computed when needed.", key, error)
