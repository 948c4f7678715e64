"""KV-cache groups: the layout of a model mixing sliding-window and full attention, the block manager's
per-group lists (sliding groups give back what their window left), and Gemma 3 served with fewer KV bytes
than full-length caches, with the same tokens."""

import numpy as np
import pytest
from hf_models import save_tiny_hf_model

from jaxrunner.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import TransformerConfig
from jaxrunner.models.kv_cache_groups import KVCacheGroups
from jaxrunner.models.tokenizer import build_byte_tokenizer

BS = 4


def gemma3_12b_layers(window: int = 1024) -> TransformerConfig:
    """Gemma-3-12B's attention pattern: 48 layers, every sixth global."""
    return TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=48,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        sliding_window=window,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)),
    )


def windows(config: TransformerConfig) -> list[int | None]:
    return [config.layer_sliding_window(i) for i in range(config.num_layers)]


def test_gemma3_layers_make_six_groups_of_eight_sharing_eight_tensors():
    groups = KVCacheGroups.for_layers(windows(gemma3_12b_layers()), max_model_len=8192)
    assert groups.num_groups == 6 and groups.num_tensors == 8
    assert groups.windows == (None, 1024, 1024, 1024, 1024, 1024)
    assert groups.layers[0] == tuple(range(5, 48, 6))  # the global layers
    # Each tensor is used by exactly one layer of each group.
    for t in range(8):
        users = [i for i in range(48) if groups.layer_tensor(i) == t]
        assert sorted(groups.layer_group(i) for i in users) == list(range(6))


def test_one_group_where_the_window_covers_every_position_or_no_layer_slides():
    assert KVCacheGroups.for_layers(windows(gemma3_12b_layers(window=4096)), max_model_len=4096).num_groups == 1
    llama = TransformerConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16
    )
    assert KVCacheGroups.for_layers(windows(llama), max_model_len=4096) == KVCacheGroups.one_group(4)


def test_a_sliding_group_gives_back_the_blocks_its_window_left():
    mgr = KVCacheManager(num_blocks=40, block_size=BS, windows=(None, 6))
    tokens = list(range(30))
    assert mgr.allocate_slots("a", tokens, 10, 0) == ([1, 2, 3], [4, 5, 6])
    # From token 10 on the window reaches back to token 5: block 0 (tokens 0-3) is no longer needed.
    new = mgr.allocate_slots("a", tokens, 10, 10)
    assert new is not None and len(new[0]) == 2 and len(new[1]) == 2
    full, sliding = mgr.get_block_ids("a")
    assert len(full) == 5 and sliding[0] == NULL_BLOCK and NULL_BLOCK not in sliding[1:]
    assert mgr.num_held_blocks("a") == 5 + 4
    mgr.allocate_slots("a", tokens, 10, 20)  # window from token 15: blocks 0-2 of the sliding group gone
    full, sliding = mgr.get_block_ids("a")
    assert sliding[:3] == [NULL_BLOCK] * 3 and mgr.num_held_blocks("a") == 8 + 5
    mgr.free("a")
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_a_prefix_hit_needs_the_window_before_it_in_every_sliding_group():
    mgr = KVCacheManager(num_blocks=40, block_size=BS, windows=(None, 6))
    prompt = list(range(21))
    assert mgr.allocate_slots("a", prompt, 21, 0) is not None  # one step: nothing released yet
    blocks, num_computed = mgr.get_computed_blocks("b", prompt)
    assert num_computed == 20
    full, sliding = blocks
    # The next token (20) reads keys from 15 on: the sliding group needs blocks 3 and 4 only.
    assert full == mgr.get_block_ids("a")[0][:5]
    assert sliding == [NULL_BLOCK] * 3 + mgr.get_block_ids("a")[1][3:5]
    assert mgr.allocate_slots("b", prompt, 1, 20, blocks) is not None
    assert mgr.num_held_blocks("b") == 6 + 3  # shared blocks plus one new block in each group
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def _peak_held(llm: LLM) -> list[int]:
    """Records the blocks held after every allocation of ``llm``'s manager."""
    manager = llm.kv_cache_manager
    peak = [0]
    allocate = manager.allocate_slots

    def recording(*args, **kwargs):
        result = allocate(*args, **kwargs)
        peak[0] = max(peak[0], manager.num_usable_blocks - manager.num_free_blocks)
        return result

    manager.allocate_slots = recording
    return peak


def test_gemma3_sliding_groups_hold_fewer_kv_bytes_with_the_same_tokens(tmp_path, cache_dir):
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("gemma3", tmp_path, seed=9, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, n).tolist() for n in (100, 90, 75)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def serve(num_blocks: int, **hybrid) -> tuple[list[list[int]], int, LLM]:
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            num_gpu_blocks_override=num_blocks,
            compilation_cache_dir=cache_dir,
            token_buckets=[8, 64],
            request_buckets=[4],
            **hybrid,
        )
        peak = _peak_held(llm)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.scheduler.num_preemptions == 0
        return tokens, peak[0], llm

    grouped_tokens, grouped_peak, grouped = serve(96)
    runner = grouped.llm_engine.runner
    assert runner.kv_cache_groups.num_groups == 3 and runner.kv_cache_spec.num_layers == 1
    grouped_bytes = grouped_peak * runner.kv_cache_spec.bytes_per_block

    full_tokens, full_peak, full = serve(32, disable_hybrid_kv_cache_manager=True)  # the same bytes: 3-layer blocks
    assert full.llm_engine.runner.kv_cache_groups.num_groups == 1
    full_bytes = full_peak * full.llm_engine.runner.kv_cache_spec.bytes_per_block

    assert grouped_tokens == full_tokens
    print(f"peak KV: grouped {grouped_peak} blocks ({grouped_bytes} B), one group {full_peak} ({full_bytes} B)")
    assert grouped_bytes < 0.75 * full_bytes


@pytest.mark.parametrize("feature", [{"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}])
def test_features_that_cannot_take_several_groups_are_refused(feature, tmp_path, cache_dir):
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("gemma3", tmp_path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="KV-cache groups"):
        LLM(str(tmp_path), max_model_len=64, num_gpu_blocks_override=16, compilation_cache_dir=cache_dir, **feature)
