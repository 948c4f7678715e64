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

KV-cache groups (vLLM's hybrid allocator): layers that attend alike share a block
table, and every group takes its blocks from the one pool. A request holds a list of
blocks per group; a sliding-window group keeps only the blocks its window still
reaches, the ones before it given back (``NULL_BLOCK`` in their place) as the
request's computed tokens pass them. A prefix hit is the longest prefix every group
has: the whole prefix for a full-attention group, the window before the hit point
for a sliding one. Every call takes and returns one list per group.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0  # Reserved: padding in block tables, never handed out.
_ROOT_HASH = 0  # Parent hash of a sequence's first block.


BlockIds = tuple[list[int], ...]
"""One list of block ids per KV-cache group."""


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
    """A request's blocks in order, one list per group (``NULL_BLOCK`` where a sliding window let one go),
    the chain hashes of its leading full blocks (its tokens', the same for every group), the parent hash
    of its first block (``_root_hash``), and per group how many leading blocks were already looked at for
    release (a window only moves forward: none is looked at twice)."""

    root: int
    blocks: BlockIds
    released: list[int]
    hashes: list[int] = dataclasses.field(default_factory=list)


class KVCacheManager:
    """Block pool, per-request block lists of every KV-cache group, and the prefix cache over them.

    ``windows`` gives each group's sliding window (None: full attention); the default
    is one full-attention group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"Need num_blocks >= 2 and block_size >= 1, got {num_blocks}, {block_size}.")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"Need one window (None or >= 1) per KV-cache group, got {windows}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.stats = PrefixCacheStats()
        self.reset()

    def reset(self) -> None:
        """Every block free and uncached, no request holding any: the pool as new.

        The engine resets it after a step that was cut short, once it dropped every
        request: an allocation may have been left half done, and blocks registered
        in the prefix cache by that step may never have been written.
        """
        self._ref_counts = [0] * self.num_blocks
        self._hashes: list[tuple[int, int] | None] = [None] * self.num_blocks  # Set iff the block is in _cached.
        self._cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        # Unreferenced blocks, head = next to hand out (least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_blocks))
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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
        """Blocks the request would have to take, over every group, to hold ``num_tokens`` tokens."""
        return sum(self._blocks_to_grow(self._requests.get(req_id), num_tokens))

    def _blocks_to_grow(self, req: _RequestBlocks | None, num_tokens: int) -> list[int]:
        """Per group, the blocks ``req`` (None: a new request) lacks to hold ``num_tokens`` tokens."""
        want = self.num_blocks_for(num_tokens, self.block_size)
        return [max(0, want - (len(req.blocks[g]) if req else 0)) for g in range(self.num_groups)]

    def blocks_to_hold(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once, computed ``max_chunk_tokens`` at most a
        step: every block of a full-attention group, a sliding group's window and chunk."""
        want = self.num_blocks_for(num_tokens, self.block_size)
        return sum(
            want if w is None else min(want, self.num_blocks_for(w - 1 + max_chunk_tokens, self.block_size) + 1)
            for w in self.windows
        )

    def max_concurrency(self, num_tokens: int, max_chunk_tokens: int) -> float:
        """Requests of ``num_tokens`` tokens the pool holds at once (vLLM's "maximum concurrency"): every
        usable block over what one such request holds at most (``blocks_to_hold``)."""
        return self.num_usable_blocks / self.blocks_to_hold(num_tokens, max_chunk_tokens)

    def get_block_ids(self, req_id: str) -> BlockIds:
        """A copy of the request's block ids in order, per group; empty lists for an unknown request."""
        req = self._requests.get(req_id)
        return tuple(list(blocks) for blocks in req.blocks) if req else tuple([] for _ in self.windows)

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request holds over every group (its released ones not counted)."""
        req = self._requests.get(req_id)
        return sum(b != NULL_BLOCK for blocks in req.blocks for b in blocks) if req else 0

    def reset_stats(self) -> PrefixCacheStats:
        """Start fresh counters; returns the previous ones (e.g. for interval logging)."""
        old, self.stats = self.stats, PrefixCacheStats()
        return old

    def _skipped_blocks(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks of ``group`` no token from ``num_computed_tokens`` on attends to (0 for full attention).

        The next token, at position ``num_computed_tokens``, reads keys from
        ``num_computed_tokens - window + 1`` on.
        """
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int | str], extra_key: str | None = None
    ) -> tuple[BlockIds, int]:
        """Cached blocks of the longest cached prefix of ``token_ids`` under ``extra_key``, per group, and
        the tokens they hold.

        The last token is always left to compute (its logits are needed), so at most
        ``(len(token_ids) - 1) // block_size`` blocks match. A sliding-window group
        needs only the blocks its window reaches from the hit point, and gives
        ``NULL_BLOCK`` before them. Only the stats change; the blocks are taken by the
        following ``allocate_slots``. ``req_id`` is unused: the lookup depends on the
        tokens and ``extra_key`` alone.
        """
        if not self.enable_caching:
            return tuple([] for _ in self.windows), 0
        bs = self.block_size
        hashes: list[int] = []
        parent = _root_hash(extra_key)
        for i in range(max(0, len(token_ids) - 1) // bs):
            parent = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        full = [g for g, w in enumerate(self.windows) if w is None]
        hit = next((n for n, h in enumerate(hashes) if any((g, h) not in self._cached for g in full)), len(hashes))
        while hit and not all(
            (g, hashes[i]) in self._cached
            for g in range(self.num_groups)
            if g not in full
            for i in range(self._skipped_blocks(g, hit * bs), hit)
        ):
            hit -= 1
        blocks = tuple(
            [NULL_BLOCK] * (skipped := self._skipped_blocks(g, hit * bs))
            + [self._cached[(g, hashes[i])] for i in range(skipped, hit)]
            for g in range(self.num_groups)
        )
        num_computed = hit * bs
        self.stats.queries += len(token_ids)
        self.stats.hits += num_computed
        return blocks, num_computed

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int | str],
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: BlockIds = (),
        extra_key: str | None = None,
    ) -> BlockIds | None:
        """Grow the request's blocks to cover ``num_computed_tokens + num_new_tokens`` tokens.

        First a sliding-window group gives back the blocks its window left behind.
        ``new_computed_blocks`` (from ``get_computed_blocks``, first call only) become the
        head of the request's lists; ``extra_key`` (first call only, as given to
        ``get_computed_blocks``) seeds the hashes of its blocks. Returns the newly appended
        block ids per group, or None, with no block taken, if the free queue is too short.
        Blocks that are full once this step's tokens are computed get registered in the
        prefix cache.
        """
        req = self._requests.get(req_id)
        if req is not None:
            self._release_skipped(req, num_computed_tokens)
        num_tokens = num_computed_tokens + num_new_tokens
        new_blocks: BlockIds = tuple([] for _ in self.windows)
        # Most decode steps stay within the request's blocks: nothing to allocate then.
        if req is None or new_computed_blocks or num_tokens > len(req.blocks[0]) * self.block_size:
            grown = self._grow(req_id, req, token_ids, num_tokens, new_computed_blocks, extra_key)
            if grown is None:
                return None
            req, new_blocks = grown
        num_full = min(len(token_ids), num_tokens) // self.block_size
        if self.enable_caching and num_full > len(req.hashes):  # most steps fill no block
            self._cache_full_blocks(req, token_ids, num_full)
        return new_blocks

    def _release_skipped(self, req: _RequestBlocks, num_computed_tokens: int) -> None:
        """Give back each sliding-window group's blocks that its window no longer reaches."""
        for g, blocks in enumerate(req.blocks):
            skipped = min(self._skipped_blocks(g, num_computed_tokens), len(blocks))
            for i in range(req.released[g], skipped):
                if blocks[i] != NULL_BLOCK:
                    self._release(blocks[i])
                    blocks[i] = NULL_BLOCK
            req.released[g] = max(req.released[g], skipped)

    def _grow(
        self,
        req_id: str,
        req: _RequestBlocks | None,
        token_ids: Sequence[int | str],
        num_tokens: int,
        computed: BlockIds,
        extra_key: str | None,
    ) -> tuple[_RequestBlocks, BlockIds] | None:
        """Take the computed blocks and enough free ones for ``num_tokens``; None if too few are free."""
        root = _root_hash(extra_key)
        computed = computed or tuple([] for _ in self.windows)
        computed_hashes = self._verified_hashes(req, token_ids, computed, root) if computed[0] else []
        num_new = [max(0, n - len(computed[g])) for g, n in enumerate(self._blocks_to_grow(req, num_tokens))]
        num_revived = sum(1 for blocks in computed for b in blocks if b != NULL_BLOCK and self._ref_counts[b] == 0)
        if sum(num_new) + num_revived > len(self._free):
            return None
        if req is None:
            req = self._requests[req_id] = _RequestBlocks(root, tuple([] for _ in self.windows), [0] * self.num_groups)
        for g, blocks in enumerate(computed):
            for block in blocks:
                if block != NULL_BLOCK:
                    self._take(block)
            req.blocks[g].extend(blocks)
        req.hashes.extend(computed_hashes)
        new_blocks = tuple([self._pop_free() for _ in range(n)] for n in num_new)
        for g, blocks in enumerate(new_blocks):
            req.blocks[g].extend(blocks)
        return req, new_blocks

    def free(self, req_id: str) -> None:
        """Release the request's blocks; the unreferenced ones join the free queue tail.

        They are queued last block first, so a request's tail blocks (the least likely
        to be shared) are evicted before its head. They stay cached until evicted.
        """
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        for blocks in req.blocks:
            for block in reversed(blocks):
                if block != NULL_BLOCK:
                    self._release(block)

    def _release(self, block: int) -> None:
        """Drop a holder of ``block``; unreferenced, it joins the free queue's tail."""
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
        self, req: _RequestBlocks | None, token_ids: Sequence[int | str], computed: BlockIds, root: int
    ) -> list[int]:
        """Chain hashes of the computed blocks, each group's (past its released ones) checked to still be
        cached for these tokens.

        Catches a stale ``get_computed_blocks`` result (blocks evicted and reused since).
        """
        if req is not None and req.blocks[0]:
            raise ValueError("new_computed_blocks may only be passed on a request's first allocation.")
        bs = self.block_size
        hashes: list[int] = []
        parent = root
        for i in range(len(computed[0])):
            parent = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            for g, blocks in enumerate(computed):
                if blocks[i] != NULL_BLOCK and self._hashes[blocks[i]] != (g, parent):
                    raise ValueError(
                        f"Computed block {blocks[i]} no longer caches this prefix; call get_computed_blocks "
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
        key = self._hashes[block]
        if key is not None:
            del self._cached[key]
            self._hashes[block] = None
        self._ref_counts[block] = 1
        return block

    def _cache_full_blocks(self, req: _RequestBlocks, token_ids: Sequence[int | str], num_full: int) -> None:
        """Hash the request's newly full blocks; register, in each group that still holds it, each hash not
        cached yet."""
        bs = self.block_size
        for i in range(len(req.hashes), num_full):
            parent = req.hashes[-1] if req.hashes else req.root
            block_hash = _block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            req.hashes.append(block_hash)
            for g, blocks in enumerate(req.blocks):
                block = blocks[i]
                if block != NULL_BLOCK and (g, block_hash) not in self._cached:
                    self._cached[(g, block_hash)] = block
                    self._hashes[block] = (g, block_hash)
