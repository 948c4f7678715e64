"""Each model family served through ``LLM``: greedy tokens equal transformers' ``generate`` under chunked
prefill, prefix caching and preemption, and nothing compiles after warm-up."""

import numpy as np
import pytest
import torch
import transformers
from hf_models import save_tiny_hf_model

from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models.tokenizer import build_byte_tokenizer
from jaxrunner.runner.compilation import CompileCounter

FAMILIES = ["phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
NUM_BLOCKS = {"gemma2": 11, "gemma3": 11}
"""Too few blocks for all four prompts at once: some are preempted and recomputed. Gemma's 3 layers keep
3 KV-cache groups (``models/kv_cache_groups.py``) of blocks a third the size; 6 for the others."""
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Mixed lengths; the second and fourth share 32 tokens (two blocks of 16), so the fourth finds them cached."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 250, 32).tolist()
    return [
        rng.integers(3, 250, 5).tolist(),
        shared + rng.integers(3, 250, 14).tolist(),
        rng.integers(3, 250, 29).tolist(),
        shared + rng.integers(3, 250, 9).tolist(),
    ]


def hf_greedy(path, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model.eval().generate(  # pyright: ignore[reportAttributeAccessIssue]
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(family, tmp_path, cache_dir):
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model(family, tmp_path, seed=5, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=64,  # within Phi-3's original positions: LongRoPE's short factors, as transformers takes
        max_num_seqs=4,
        max_num_batched_tokens=24,  # the 46- and 41-token prompts are prefilled in chunks
        num_gpu_blocks_override=NUM_BLOCKS.get(family, 6),
        compilation_cache_dir=cache_dir,
        token_buckets=[8, 24],
        request_buckets=[4],
    )
    batch = prompts()
    compiled = CompileCounter.count()  # the engine compiled every step it can take when it started
    first = llm.generate(batch[:2], GREEDY, use_tqdm=False)  # the shared prefix computed and cached
    # The second shared-prefix prompt first, so that it finds the prefix before the other prompt's blocks
    # evict it (a sliding-window group gives its early blocks back, oldest in the free queue).
    second = llm.generate([batch[3], batch[2]], GREEDY, use_tqdm=False)
    assert CompileCounter.count() == compiled, "a step compiled after warm-up"
    got = [o.outputs[0].token_ids for o in (*first, second[1], second[0])]

    assert got == [hf_greedy(tmp_path, p) for p in batch]
    scheduler, manager = llm.llm_engine.scheduler, llm.kv_cache_manager
    if family not in NUM_BLOCKS:  # Gemma's sliding groups give early blocks back: tests/test_kv_cache_groups.py
        assert manager.stats.hits >= 32, "the second shared-prefix prompt did not hit the cache"
    assert scheduler.num_preemptions > 0
    assert manager.num_free_blocks == manager.num_usable_blocks
