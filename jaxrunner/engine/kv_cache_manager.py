"""Host-side KV block manager with automatic prefix caching (vLLM V1 semantics).

The pool hands out fixed-size KV blocks. Each block has a reference count (how
many running requests hold it); blocks nobody holds sit in a free queue in LRU
order. A FULL block is also registered under a hash chained with its parent's,
so a later request whose prompt starts with the same tokens can reuse the KV
instead of recomputing it. A request's ``extra_key`` (its LoRA adapter's name,
as vLLM's extra hash keys) seeds its chain: requests of different keys never
share a block, requests of the same key do. The ids hashed may carry an image's
content hash in place of its first placeholder token (``Request.block_hash_ids``):
images are part of the KV they make. Freed blocks keep their hash until the free
queue hands them out again, which is the eviction. Every call touches only the blocks
it takes, frees or hashes; nothing scans the pool (except reset_prefix_cache,
which walks the cached blocks once).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0  # Reserved: padding in block tables, never handed out.
_ROOT_HASH = 0  # Parent hash of a sequence's first block.


def _block_hash(parent: int, block_tokens: Sequence[int | str]) -> int:
    """Hash of a full block: its tokens chained with everything before it."""
    return hash((parent, tuple(block_tokens)))


def _root_hash(extra_key: str | None) -> int:
    """Parent hash of a sequence's first block: what besides the tokens its KV depends on."""
    return _ROOT_HASH if extra_key is None else hash((_ROOT_HASH, extra_key))


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens: tokens looked up, tokens found cached."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached tokens over looked-up tokens (0 before any lookup)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclasses.dataclass
class _RequestBlocks:
    """A request's blocks in order, the chain hashes of its leading full blocks, and the parent hash of
    its first block (``_root_hash``)."""

    root: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)


class KVCacheManager:
    """Block pool, per-request block lists and the prefix cache over them."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"Need num_blocks >= 2 and block_size >= 1, got {num_blocks}, {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        self.reset()

    def reset(self) -> None:
        """Every block free and uncached, no request holding any: the pool as new.

        The engine resets it after a step that was cut short, once it dropped every
        request: an allocation may have been left half done, and blocks registered
        in the prefix cache by that step may never have been written.
        """
        self._ref_counts = [0] * self.num_blocks
        self._hashes: list[int | None] = [None] * self.num_blocks  # Set iff the block is in _cached.
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Unreferenced blocks, head = next to hand out (least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_blocks))
        self._requests: dict[str, _RequestBlocks] = {}

    @staticmethod
    def num_blocks_for(num_tokens: int, block_size: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the reserved null block."""
        return self.num_blocks - 1

    def can_fit(self, num_blocks_needed: int) -> bool:
        """Whether ``num_blocks_needed`` blocks are free now (cached free blocks count)."""
        return num_blocks_needed <= self.num_free_blocks

    def num_blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """Blocks the request would have to take to hold ``num_tokens`` tokens."""
        req = self._requests.get(req_id)
        return max(0, self.num_blocks_for(num_tokens, self.block_size) - (len(req.blocks) if req else 0))

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block ids in order; [] for an unknown request."""
        req = self._requests.get(req_id)
        return list(req.blocks) if req else []

    def reset_stats(self) -> PrefixCacheStats:
        """Start fresh counters; returns the previous ones (e.g. for interval logging)."""
        old, self.stats = self.stats, PrefixCacheStats()
        return old

    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int | str], extra_key: str | None = None
    ) -> tuple[list[int], int]:
        """Cached blocks of the longest cached prefix of ``token_ids`` under ``extra_key`` and the tokens
        they hold.

        The last token is always left to compute (its logits are needed), so at most
        ``(len(token_ids) - 1) // block_size`` blocks match. Only the stats change; the
        blocks are taken by the following ``allocate_slots``. ``req_id`` is unused: the
        lookup depends on the tokens and ``extra_key`` alone.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        blocks: list[int] = []
        parent = _root_hash(extra_key)
        for i in range(max(0, len(token_ids) - 1) // bs):
            parent = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(parent)
            if block is None:
                break
            blocks.append(block)
        num_computed = len(blocks) * bs
        self.stats.queries += len(token_ids)
        self.stats.hits += num_computed
        return blocks, num_computed

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int | str],
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        extra_key: str | None = None,
    ) -> list[int] | None:
        """Grow the request's blocks to cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``new_computed_blocks`` (from ``get_computed_blocks``, first call only) become the
        head of the request's list; ``extra_key`` (first call only, as given to
        ``get_computed_blocks``) seeds the hashes of its blocks. Returns the newly appended block ids, or None, with
        nothing changed, if the free queue is too short. Blocks that are full once this
        step's tokens are computed get registered in the prefix cache.
        """
        req = self._requests.get(req_id)
        num_tokens = num_computed_tokens + num_new_tokens
        new_blocks: list[int] = []
        # Most decode steps stay within the request's blocks: nothing to allocate then.
        if req is None or new_computed_blocks or num_tokens > len(req.blocks) * self.block_size:
            grown = self._grow(req_id, req, token_ids, num_tokens, list(new_computed_blocks), extra_key)
            if grown is None:
                return None
            req, new_blocks = grown
        num_full = min(len(token_ids), num_tokens) // self.block_size
        if self.enable_caching and num_full > len(req.hashes):  # most steps fill no block
            self._cache_full_blocks(req, token_ids, num_full)
        return new_blocks

    def _grow(
        self,
        req_id: str,
        req: _RequestBlocks | None,
        token_ids: Sequence[int | str],
        num_tokens: int,
        computed: list[int],
        extra_key: str | None,
    ) -> tuple[_RequestBlocks, list[int]] | None:
        """Take the computed blocks and enough free ones for ``num_tokens``; None if too few are free."""
        root = _root_hash(extra_key)
        computed_hashes = self._verified_hashes(req, token_ids, computed, root) if computed else []
        num_new = max(0, self.num_blocks_to_grow(req_id, num_tokens) - len(computed))
        num_revived = sum(1 for b in computed if self._ref_counts[b] == 0)
        if num_new + num_revived > len(self._free):
            return None
        if req is None:
            req = self._requests[req_id] = _RequestBlocks(root)
        for block in computed:
            self._take(block)
        req.blocks.extend(computed)
        req.hashes.extend(computed_hashes)
        new_blocks = [self._pop_free() for _ in range(num_new)]
        req.blocks.extend(new_blocks)
        return req, new_blocks

    def free(self, req_id: str) -> None:
        """Release the request's blocks; the unreferenced ones join the free queue tail.

        They are queued last block first, so a request's tail blocks (the least likely
        to be shared) are evicted before its head. They stay cached until evicted.
        """
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        for block in reversed(req.blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            self._hashes[block] = None
        self._cached.clear()
        return True

    def _verified_hashes(
        self, req: _RequestBlocks | None, token_ids: Sequence[int | str], computed: list[int], root: int
    ) -> list[int]:
        """Chain hashes of the computed blocks, checked to still be cached for these tokens.

        Catches a stale ``get_computed_blocks`` result (blocks evicted and reused since).
        """
        if req is not None and req.blocks:
            raise ValueError("new_computed_blocks may only be passed on a request's first allocation.")
        bs = self.block_size
        hashes: list[int] = []
        parent = root
        for i, block in enumerate(computed):
            parent = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if self._hashes[block] != parent:
                raise ValueError(
                    f"Computed block {block} no longer caches this prefix; call get_computed_blocks "
                    "right before allocate_slots."
                )
            hashes.append(parent)
        return hashes

    def _take(self, block: int) -> None:
        """Add a holder to a cached block, taking it off the free queue if it was there."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _pop_free(self) -> int:
        """Hand out the free queue's head, evicting its cached hash if it has one."""
        block, _ = self._free.popitem(last=False)
        block_hash = self._hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block] = None
        self._ref_counts[block] = 1
        return block

    def _cache_full_blocks(self, req: _RequestBlocks, token_ids: Sequence[int | str], num_full: int) -> None:
        """Hash the request's newly full blocks; register each hash not cached yet."""
        bs = self.block_size
        for i in range(len(req.hashes), num_full):
            parent = req.hashes[-1] if req.hashes else req.root
            block_hash = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            req.hashes.append(block_hash)
            if block_hash not in self._cached:
                block = req.blocks[i]
                self._cached[block_hash] = block
                self._hashes[block] = block_hash
