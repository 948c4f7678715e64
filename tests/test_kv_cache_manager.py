"""KV block manager: allocation, reference counts, prefix-cache hits and LRU eviction."""

import random

import pytest

from jaxrunner.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager

BS = 4


def ids(mgr: KVCacheManager, req_id: str) -> list[int]:
    """The request's blocks of a one-group manager."""
    (blocks,) = mgr.get_block_ids(req_id)
    return blocks


def computed(mgr: KVCacheManager, req_id: str, tokens: list[int]) -> tuple[list[int], int]:
    """``get_computed_blocks`` of a one-group manager: the group's blocks and the tokens they hold."""
    blocks, num_computed = mgr.get_computed_blocks(req_id, tokens)
    return (blocks[0] if blocks else []), num_computed


def alloc(mgr: KVCacheManager, req_id, tokens, num_new, num_computed, blocks=()) -> list[int] | None:
    """``allocate_slots`` of a one-group manager: the group's new blocks, or None."""
    new = mgr.allocate_slots(req_id, tokens, num_new, num_computed, (list(blocks),) if blocks else ())
    return None if new is None else new[0]


def admit(mgr: KVCacheManager, req_id: str, tokens: list[int]) -> list[int] | None:
    """Admit a request with its whole prompt scheduled, as the scheduler does."""
    blocks, num_computed = computed(mgr, req_id, tokens)
    return alloc(mgr, req_id, tokens, len(tokens) - num_computed, num_computed, blocks)


def usage(mgr: KVCacheManager) -> float:
    """Fraction of usable blocks held by running requests."""
    return 1.0 - mgr.num_free_blocks / mgr.num_usable_blocks


def snapshot(mgr: KVCacheManager) -> tuple:
    return (
        list(mgr._ref_counts),
        list(mgr._free),
        dict(mgr._cached),
        {r: ids(mgr, r) for r in mgr._requests},
        mgr.stats.queries,
        mgr.stats.hits,
    )


def test_allocate_and_free_return_the_pool():
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    assert mgr.num_usable_blocks == 10 and mgr.num_free_blocks == 10 and usage(mgr) == 0.0
    assert admit(mgr, "a", list(range(9))) == [1, 2, 3]
    assert alloc(mgr, "a", list(range(12)), 3, 9) == []  # still fits block 3
    assert alloc(mgr, "a", list(range(13)), 1, 12) == [4]
    assert admit(mgr, "b", list(range(100, 105))) == [5, 6]
    assert ids(mgr, "a") == [1, 2, 3, 4]
    assert mgr.num_free_blocks == 4 and usage(mgr) == pytest.approx(0.6)
    mgr.free("a")
    mgr.free("b")
    mgr.free("unknown")
    assert mgr.num_free_blocks == 10 and ids(mgr, "a") == []
    assert KVCacheManager.num_blocks_for(0, BS) == 0
    assert KVCacheManager.num_blocks_for(5, BS) == 2


def test_same_prompt_hits_full_blocks_up_to_the_last_token_cap():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(16))  # exactly 4 full blocks
    admit(mgr, "a", prompt)
    assert mgr.stats.queries == 16 and mgr.stats.hits == 0
    blocks, num_computed = computed(mgr, "b", prompt)
    assert blocks == ids(mgr, "a")[:3] and num_computed == 12  # last block recomputed
    blocks, num_computed = computed(mgr, "c", prompt + [99])
    assert blocks == ids(mgr, "a") and num_computed == 16
    assert mgr.stats.queries == 16 + 16 + 17 and mgr.stats.hits == 28
    assert mgr.stats.hit_rate == pytest.approx(28 / 49)
    old = mgr.reset_stats()
    assert old.hits == 28 and mgr.stats.queries == 0 and mgr.stats.hit_rate == 0.0


def test_lookup_changes_nothing_but_stats():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    admit(mgr, "a", list(range(9)))
    mgr.free("a")
    before = snapshot(mgr)
    computed(mgr, "b", list(range(9)))
    assert snapshot(mgr)[:4] == before[:4]


def test_different_prompts_do_not_collide():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    admit(mgr, "a", list(range(9)))
    assert computed(mgr, "b", list(range(50, 59))) == ([], 0)
    assert mgr.stats.hits == 0


def test_shared_prefix_hits_only_the_shared_full_blocks():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prefix = list(range(6))  # one full block, then two shared tokens of the second
    admit(mgr, "a", prefix + [7, 7, 7, 7])
    blocks, num_computed = computed(mgr, "b", prefix + [8, 8, 8, 8])
    assert blocks == ids(mgr, "a")[:1] and num_computed == 4


def test_hashes_chain_over_the_prefix():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    admit(mgr, "a", [1, 1, 1, 1, 5, 5, 5, 5, 0])
    # The second block's tokens match, but under a different first block.
    assert computed(mgr, "b", [2, 2, 2, 2, 5, 5, 5, 5, 0]) == ([], 0)


def test_generated_tokens_become_cached_as_blocks_fill():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = [1, 2, 3]
    admit(mgr, "a", tokens)
    for t in range(4, 10):  # decode one token per step
        tokens = tokens + [t]
        alloc(mgr, "a", tokens, 1, len(tokens) - 1)
    blocks, num_computed = computed(mgr, "b", tokens + [0])
    assert blocks == ids(mgr, "a")[:2] and num_computed == 8


def test_chunked_prefill_caches_only_computed_blocks():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(13))
    alloc(mgr, "a", prompt, 6, 0)  # first chunk: one full block computed
    assert computed(mgr, "b", prompt)[1] == 4
    alloc(mgr, "a", prompt, 7, 6)
    assert computed(mgr, "b", prompt)[1] == 12


def test_duplicate_block_keeps_the_existing_cache_entry():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    alloc(mgr, "b", prompt, 9, 0)  # computes the same blocks without a lookup
    a_blocks = computed(mgr, "c", prompt)[0]
    assert a_blocks == ids(mgr, "a")[:2]
    mgr.free("b")
    mgr.free("a")
    assert computed(mgr, "c", prompt)[0] == a_blocks


def test_lru_eviction_takes_least_recently_freed_and_tail_blocks_first():
    mgr = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    prompt_a, prompt_b = list(range(9)), list(range(100, 109))  # 2 full blocks + 1 partial each
    admit(mgr, "a", prompt_a)
    admit(mgr, "b", prompt_b)
    a0, a1, a2 = ids(mgr, "a")
    mgr.free("a")
    mgr.free("b")
    assert list(mgr._free)[:3] == [a2, a1, a0]
    assert alloc(mgr, "c", list(range(50, 58)), 8, 0) == [a2, a1]
    assert computed(mgr, "x", prompt_a) == ([a0], 4)  # a1 evicted, a0 still cached
    assert computed(mgr, "x", prompt_b)[1] == 8  # b untouched


def test_blocks_of_running_requests_are_never_evicted():
    mgr = KVCacheManager(num_blocks=7, block_size=BS)
    admit(mgr, "a", list(range(9)))
    admit(mgr, "b", list(range(100, 109)))
    mgr.free("a")
    held = set(ids(mgr, "b"))
    taken = alloc(mgr, "c", list(range(50, 62)), 12, 0)
    assert taken is not None and len(taken) == 3 and not held & set(taken)
    assert alloc(mgr, "d", [1], 1, 0) is None
    assert computed(mgr, "x", list(range(100, 109)))[1] == 8


def test_failed_allocation_changes_nothing():
    mgr = KVCacheManager(num_blocks=7, block_size=BS)
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    mgr.free("a")  # its two full blocks are now cached and free
    admit(mgr, "b", list(range(100, 109)))
    blocks, num_computed = computed(mgr, "c", prompt + list(range(20, 30)))
    assert num_computed == 8
    before = snapshot(mgr)
    # Needs the 2 cached free blocks plus 3 new ones; only 3 are free in total.
    assert alloc(mgr, "c", prompt + list(range(20, 30)), 11, 8, blocks) is None
    assert snapshot(mgr) == before
    assert alloc(mgr, "b", list(range(100, 130)), 21, 9) is None
    assert snapshot(mgr) == before


def test_shared_blocks_are_ref_counted():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(10))
    admit(mgr, "parent", prompt)
    for child in ("c0", "c1"):  # n > 1 sampling: children share the prompt's full blocks
        assert admit(mgr, child, prompt) is not None
    shared = ids(mgr, "parent")[:2]
    assert [mgr._ref_counts[b] for b in shared] == [3, 3]
    assert ids(mgr, "c0")[:2] == shared and ids(mgr, "c0")[2] not in shared
    free_before = mgr.num_free_blocks
    mgr.free("parent")
    assert [mgr._ref_counts[b] for b in shared] == [2, 2]
    assert mgr.num_free_blocks == free_before + 1  # only the parent's own partial block
    mgr.free("c0")
    mgr.free("c1")
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_revived_cached_block_leaves_the_free_queue():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    mgr.free("a")
    blocks, _ = computed(mgr, "b", prompt)
    admit(mgr, "b", prompt)
    assert all(b not in mgr._free and mgr._ref_counts[b] == 1 for b in blocks)


def test_stale_computed_blocks_are_rejected():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    mgr.free("a")
    blocks, num_computed = computed(mgr, "b", prompt)
    admit(mgr, "c", list(range(50, 62)))  # evicts and reuses every block
    with pytest.raises(ValueError, match="no longer caches"):
        alloc(mgr, "b", prompt, 1, num_computed, blocks)


def test_caching_disabled():
    mgr = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    assert computed(mgr, "b", prompt) == ([], 0)
    assert mgr.stats.queries == 0 and not mgr._cached
    mgr.free("a")
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_reset_prefix_cache():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(9))
    admit(mgr, "a", prompt)
    assert mgr.reset_prefix_cache() is False
    assert computed(mgr, "b", prompt)[1] == 8
    mgr.free("a")
    assert mgr.reset_prefix_cache() is True
    assert computed(mgr, "b", prompt) == ([], 0)
    assert admit(mgr, "b", prompt) is not None  # freed blocks are reusable after the reset


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_invariants(seed):
    """Random admissions, chunked prefills, decodes, preemptions and frees.

    Alongside the manager, a fake KV store records which token each block slot holds, so
    every prefix hit is checked to point at blocks holding exactly the request's tokens.
    """
    rng = random.Random(seed)
    num_blocks = 40
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    kv: dict[int, list[int | None]] = {}
    families = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    requests: dict[str, dict] = {}  # req_id -> {"tokens": all known tokens, "computed": int}

    def write_kv(req_id: str, start: int, end: int) -> None:
        blocks, tokens = ids(mgr, req_id), requests[req_id]["tokens"]
        for pos in range(start, end):
            kv[blocks[pos // BS]][pos % BS] = tokens[pos]

    def check_invariants() -> None:
        holders: dict[int, int] = {}
        for req_id in requests:
            blocks = ids(mgr, req_id)
            assert len(blocks) == len(set(blocks)) and NULL_BLOCK not in blocks
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        free = list(mgr._free)
        assert len(free) == len(set(free)) and not set(free) & holders.keys()
        assert set(free) | holders.keys() == set(range(1, num_blocks))
        assert all(mgr._ref_counts[b] == holders.get(b, 0) for b in range(num_blocks))
        assert all(mgr._hashes[b] == h for h, b in mgr._cached.items())

    for step in range(600):
        op = rng.random()
        if op < 0.35 or not requests:
            req_id = f"r{step}"
            tokens = rng.choice(families) + [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            blocks, num_computed = computed(mgr, req_id, tokens)
            for i, b in enumerate(blocks):
                assert kv[b] == tokens[i * BS : (i + 1) * BS]
            chunk = rng.randrange(1, len(tokens) - num_computed + 1)
            before = snapshot(mgr)[:4]
            new_blocks = alloc(mgr, req_id, tokens, chunk, num_computed, blocks)
            if new_blocks is None:
                assert snapshot(mgr)[:4] == before
                continue
            requests[req_id] = {"tokens": tokens, "computed": num_computed}
        elif op < 0.85:
            req_id = rng.choice(list(requests))
            req = requests[req_id]
            if req["computed"] == len(req["tokens"]):
                req["tokens"] = req["tokens"] + [rng.randrange(3)]  # a sampled token
            chunk = rng.randrange(1, len(req["tokens"]) - req["computed"] + 1)
            before = snapshot(mgr)[:4]
            new_blocks = alloc(mgr, req_id, req["tokens"], chunk, req["computed"])
            if new_blocks is None:
                assert snapshot(mgr)[:4] == before
                mgr.free(req_id)  # preempted
                del requests[req_id]
                check_invariants()
                continue
        else:
            req_id = rng.choice(list(requests))
            mgr.free(req_id)
            del requests[req_id]
            check_invariants()
            continue
        for b in new_blocks:  # a reused block's old contents are gone
            kv[b] = [None] * BS
        write_kv(req_id, requests[req_id]["computed"], requests[req_id]["computed"] + chunk)
        requests[req_id]["computed"] += chunk
        check_invariants()

    for req_id in list(requests):
        mgr.free(req_id)
    requests.clear()
    check_invariants()
    assert mgr.num_free_blocks == mgr.num_usable_blocks
    assert mgr.stats.hits > 0
