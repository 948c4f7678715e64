"""KV connectors through ``LLM``: host-memory offloading of an evicted prefix, a prefill engine handing prompts'
KV to a decode engine through files, and every fault falling back to computing the tokens (greedy tokens
always those of an engine without a connector)."""

import numpy as np
import pytest

from jaxrunner import LLM, SamplingParams
from jaxrunner.runner.compilation import CompileCounter

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
RNG = np.random.default_rng(0)
DOC_A, DOC_B = RNG.integers(3, 250, 96).tolist(), RNG.integers(3, 250, 96).tolist()
QUESTIONS = [RNG.integers(3, 250, n).tolist() for n in (10, 7, 13)]
# Document A, then B (whose blocks push A's out of an 11-block cache), then A again with another question.
TURNS = [DOC_A + QUESTIONS[0], DOC_B + QUESTIONS[1], DOC_A + QUESTIONS[2]]


def offloading(num_cpu_blocks: int = 64) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks}}


def shared(path, role: str) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def make_llm(**kwargs) -> LLM:
    """The tiny model with few buckets (few programs to compile), an 11-block cache unless given."""
    options = dict(max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=11, token_buckets=[8, 128])
    return LLM("tiny-llama", **{**options, "request_buckets": [4], **kwargs})


def run_turns(llm: LLM, turns=TURNS) -> list[list[int]]:
    """Each turn alone, one after the other (a multi-turn user): the same schedule with or without a connector."""
    return [list(llm.generate({"prompt_token_ids": t}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) for t in turns]


def assert_balanced(llm: LLM) -> None:
    manager = llm.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    connector = llm.llm_engine.runner.kv_connector
    assert not getattr(connector, "_requests", {}) and not getattr(connector, "_in_flight", [])


@pytest.fixture(scope="module")
def without_connector() -> tuple[list[list[int]], int]:
    llm = make_llm()
    return run_turns(llm), llm.llm_engine.scheduler.num_scheduled_tokens_total


def test_offloading_loads_an_evicted_prefix_instead_of_computing_it(without_connector):
    expected, computed_without = without_connector
    llm = make_llm(kv_transfer_config=offloading())
    compiles = CompileCounter.count()
    assert run_turns(llm) == expected
    assert CompileCounter.count() == compiles  # loads and saves run precompiled programs
    stats = llm.llm_engine.runner.kv_connector.stats
    assert stats.loaded_blocks > 0 and stats.load_failures == stats.save_failures == 0
    assert llm.llm_engine.scheduler.num_scheduled_tokens_total == computed_without - stats.loaded_tokens
    assert_balanced(llm)


def test_under_tensor_parallelism_each_device_offloads_its_own_kv_heads(without_connector):
    expected, computed_without = without_connector
    llm = make_llm(kv_transfer_config=offloading(), tensor_parallel_size=2)
    assert run_turns(llm) == expected
    stats = llm.llm_engine.runner.kv_connector.stats
    assert stats.loaded_blocks > 0
    assert llm.llm_engine.scheduler.num_scheduled_tokens_total == computed_without - stats.loaded_tokens
    pool = llm.llm_engine.runner.kv_connector.store  # pyright: ignore[reportAttributeAccessIssue]
    k, _ = next(iter(pool._blocks.values()))
    heads = llm.llm_engine.runner.kv_cache_spec.num_kv_heads
    assert k.sharding.memory_kind == "pinned_host" and len(k.addressable_shards) == 2
    assert all(shard.data.shape[2] == heads // 2 for shard in k.addressable_shards)  # one copy, split on heads
    assert_balanced(llm)


def test_noop_connector_changes_nothing(without_connector):
    expected, computed_without = without_connector
    llm = make_llm(kv_transfer_config={"kv_connector": "NoOpConnector"})
    assert run_turns(llm) == expected
    assert llm.llm_engine.scheduler.num_scheduled_tokens_total == computed_without


def test_a_full_host_pool_drops_its_oldest_blocks(without_connector):
    expected, computed_without = without_connector
    llm = make_llm(kv_transfer_config=offloading(num_cpu_blocks=4))
    assert run_turns(llm) == expected
    pool = llm.llm_engine.runner.kv_connector.store  # pyright: ignore[reportAttributeAccessIssue]
    assert len(pool) == 4 and pool.num_evicted > 0
    # The CPU backend offers pinned host memory, as a GPU's does: the pool holds its blocks there, not in numpy.
    assert all(array.sharding.memory_kind == "pinned_host" for block in pool._blocks.values() for array in block)
    stats = llm.llm_engine.runner.kv_connector.stats
    assert llm.llm_engine.scheduler.num_scheduled_tokens_total == computed_without - stats.loaded_tokens
    assert_balanced(llm)


def test_prefill_engine_hands_prompts_to_a_decode_engine(tmp_path):
    prompts = [DOC_A + QUESTIONS[0], DOC_B[:37], DOC_A[:48]]  # a partial last block, and a whole one
    big = dict(num_gpu_blocks_override=64)  # room for all three: nothing preempted
    single = make_llm(**big)
    expected = [list(o.outputs[0].token_ids) for o in single.generate(prompts, GREEDY, use_tqdm=False)]

    producer = make_llm(kv_transfer_config=shared(tmp_path, "kv_producer"), **big)
    producer.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    consumer = make_llm(kv_transfer_config=shared(tmp_path, "kv_consumer"), **big)
    consumer.kv_cache_manager.reset_stats()
    outputs = consumer.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # The decode engine computed each prompt's last token and then decoded, nothing else: every other prompt
    # token came from the store, or from its own prefix cache (the third prompt starts as the first).
    decoded = len(prompts) * (MAX_TOKENS - 1)
    assert consumer.llm_engine.scheduler.num_scheduled_tokens_total == len(prompts) + decoded
    device_hits = consumer.kv_cache_manager.reset_stats().hits
    loaded = consumer.llm_engine.runner.kv_connector.stats.loaded_tokens
    assert loaded > 0 and loaded + device_hits == sum(len(p) - 1 for p in prompts)
    assert_balanced(producer)
    assert_balanced(consumer)


def test_corrupt_and_missing_blocks_are_computed_again(tmp_path):
    prompt = DOC_A + QUESTIONS[0]  # six full blocks and a tail
    expected = run_turns(make_llm(), [prompt])
    producer = make_llm(kv_transfer_config=shared(tmp_path, "kv_producer"))
    producer.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    connector = producer.llm_engine.runner.kv_connector
    files = sorted(tmp_path.glob("*.npz"), key=lambda f: f.stat().st_mtime_ns)
    assert len(files) == 7 and connector.stats.saved_blocks == 7
    keys = connector._keys(_Prompt(prompt), 6)  # pyright: ignore[reportAttributeAccessIssue]
    (tmp_path / f"{keys[2]}.npz").write_bytes(b"not a block")  # a load that fails midway, at the third block
    consumer = make_llm(kv_transfer_config=shared(tmp_path, "kv_consumer"))
    assert run_turns(consumer, [prompt]) == expected
    stats = consumer.llm_engine.runner.kv_connector.stats
    assert stats.load_failures == 1 and stats.loaded_tokens == 2 * 16  # the two blocks before it
    assert consumer.llm_engine.scheduler.num_scheduled_tokens_total == len(prompt) - 32 + MAX_TOKENS - 1
    (tmp_path / f"{keys[0]}.npz").unlink()  # a missing first block: nothing loads, nothing fails
    again = make_llm(kv_transfer_config=shared(tmp_path, "kv_consumer"))
    assert run_turns(again, [prompt]) == expected
    assert again.llm_engine.runner.kv_connector.stats.loaded_tokens == 0
    assert_balanced(consumer)


def test_an_unwritable_store_counts_its_failures_and_changes_nothing(tmp_path, without_connector):
    expected, _ = without_connector
    llm = make_llm(kv_transfer_config=shared(tmp_path / "store", "kv_both"))
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("a file where the store's directory was")
    assert run_turns(llm) == expected
    stats = llm.llm_engine.runner.kv_connector.stats
    assert stats.save_failures > 0 and stats.saved_blocks == 0
    assert_balanced(llm)


def test_bad_connector_settings_are_refused():
    with pytest.raises(ValueError, match="is not one of OffloadingConnector"):
        make_llm(kv_transfer_config={"kv_connector": "LMCacheConnector"})
    with pytest.raises(ValueError, match="needs kv_connector_extra_config=\\{'num_cpu_blocks': n\\}"):
        make_llm(kv_transfer_config={"kv_connector": "OffloadingConnector"})
    with pytest.raises(ValueError, match="kv_role must be"):
        make_llm(kv_transfer_config={"kv_connector": "NoOpConnector", "kv_role": "both"})


class _Prompt:
    """A request as the connector reads it, for computing a prompt's block keys in a test."""

    def __init__(self, tokens: list[int]):
        self.request_id, self.prompt_token_ids, self.block_hash_ids = "keys", tokens, tokens
        self.num_computed_tokens, self.lora_name = 0, None
