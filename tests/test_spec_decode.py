"""Speculative decoding through the engine: greedy tokens and logprobs equal without it, acceptance, no recompiles."""

import numpy as np
import transformers
from hf_models import save_tiny_hf_model
from runner_driver import tiny_llm

from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import TransformerConfig
from jaxrunner.runner.compilation import CompileCounter

GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)


def assert_same_logprobs(got, expected) -> None:
    """Completions with the same tokens carry the same logprobs (to 1e-4): the chosen token's,
    its rank, and the top ones (a token in both top lists has the same value)."""
    assert got.token_ids == expected.token_ids and len(got.logprobs) == len(got.token_ids)
    for token, have, want in zip(got.token_ids, got.logprobs, expected.logprobs):
        assert abs(have[token].logprob - want[token].logprob) < 1e-4 and have[token].rank == want[token].rank
        for other in set(have) & set(want):
            assert abs(have[other].logprob - want[other].logprob) < 1e-4
        assert len(have) == len(want)
    assert abs(got.cumulative_logprob - expected.cumulative_logprob) < 1e-3


def make_llm(cache_dir, spec: bool):
    return tiny_llm(cache_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3} if spec else None)


def prompts():
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 259, 7).tolist()
    repetitive = [phrase * 4, (phrase[:3] * 6)[:17], phrase * 2 + [5, 6]]
    return repetitive + [rng.integers(3, 259, n).tolist() for n in (5, 40, 11, 23)]


def test_greedy_outputs_equal_without_speculation_and_drafts_are_accepted(cache_dir):
    """The tokens, and their logprobs, of the engine without speculation."""
    batch = prompts()  # 7 prompts over 4 slots: prefills join while others decode
    plain = [o.outputs[0] for o in make_llm(cache_dir, spec=False).generate(batch, GREEDY_LOGPROBS, use_tqdm=False)]
    spec_llm = make_llm(cache_dir, spec=True)
    compiled = CompileCounter.count()
    speculative = [o.outputs[0] for o in spec_llm.generate(batch, GREEDY_LOGPROBS, use_tqdm=False)]
    for got, expected in zip(speculative, plain):
        assert_same_logprobs(got, expected)
    stats = spec_llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.mean_accepted_length > 1.0
    assert all(0.0 <= rate <= 1.0 for rate in stats.acceptance_rate_per_position)
    assert CompileCounter.count() == compiled  # every program was precompiled
    manager = spec_llm.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_seeded_sampling_with_speculation_is_reproducible_and_within_limits(cache_dir):
    llm = make_llm(cache_dir, spec=True)
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=15, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    assert first == again and all(len(t) == 15 for t in first)


def test_draft_model_greedy_equals_no_speculation(cache_dir, tmp_path):
    """Tokens and logprobs, with perfect drafts and with another model's."""
    batch = prompts()
    plain = [o.outputs[0] for o in make_llm(cache_dir, spec=False).generate(batch, GREEDY_LOGPROBS, use_tqdm=False)]
    # The built-in draft has the target's own weights (perfect drafts); the saved one is another model.
    save_tiny_hf_model("llama", tmp_path, seed=2, vocab_size=320, num_hidden_layers=1)
    for draft, perfect in (("tiny-llama", True), (str(tmp_path), False)):
        llm = tiny_llm(
            cache_dir,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": draft},
        )
        compiled = CompileCounter.count()
        out = [o.outputs[0] for o in llm.generate(batch, GREEDY_LOGPROBS, use_tqdm=False)]
        for got, expected in zip(out, plain):
            assert_same_logprobs(got, expected)
        assert CompileCounter.count() == compiled
        stats = llm.llm_engine.scheduler.spec_stats
        assert stats.num_drafts > 0
        if perfect:
            assert stats.mean_accepted_length > 3.0
        manager = llm.kv_cache_manager
        assert manager.num_free_blocks == manager.num_usable_blocks


def save_tiny_eagle_head(path, seed: int = 0) -> None:
    """A random EAGLE head for the built-in tiny model, saved as an HF-style checkpoint."""
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxrunner.models.builtin import BUILTIN_MODELS
    from jaxrunner.models.eagle import EagleHead
    from jaxrunner.models.loader import hf_tensors

    target = BUILTIN_MODELS["tiny-llama"]
    hf_config = transformers.LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target.num_heads,
        num_key_value_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        architectures=["EagleLlamaForCausalLM"],
    )
    hf_config.save_pretrained(path)
    head = EagleHead(TransformerConfig.from_hf(hf_config), rngs=nnx.Rngs(seed))
    save_file(hf_tensors(head), str(path / "model.safetensors"))


def test_eagle_head_greedy_equals_no_speculation(cache_dir, tmp_path):
    """Tokens and logprobs, with a random head's drafts."""
    batch = prompts()
    plain = [o.outputs[0] for o in make_llm(cache_dir, spec=False).generate(batch, GREEDY_LOGPROBS, use_tqdm=False)]
    save_tiny_eagle_head(tmp_path)
    llm = tiny_llm(
        cache_dir,
        speculative_config={"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path)},
    )
    compiled = CompileCounter.count()
    out = [o.outputs[0] for o in llm.generate(batch, GREEDY_LOGPROBS, use_tqdm=False)]
    for got, expected in zip(out, plain):
        assert_same_logprobs(got, expected)
    assert CompileCounter.count() == compiled
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    manager = llm.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_nothing_compiles_after_warm_up_with_everything_on(cache_dir):
    """Prompt logprobs, sample logprobs, a grammar, penalties and draft-model speculation in one
    run (async scheduling on; the grammar's steps one at a time) use only precompiled programs."""
    from jaxrunner.engine.structured_outputs import StructuredOutputsParams

    llm = tiny_llm(
        cache_dir,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": "tiny-llama"},
    )
    runner = llm.llm_engine.runner
    compiled, programs = CompileCounter.count(), runner.num_compiled_programs
    grammar = StructuredOutputsParams(regex="[a-c]{3,9}")
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, structured_outputs=grammar),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.2, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12, frequency_penalty=0.4, logprobs=3, ignore_eos=True),
    ]
    batch = prompts()
    outputs = llm.generate(batch, [params[i % len(params)] for i in range(len(batch))], use_tqdm=False)
    assert all(o.error is None for o in outputs)
    assert outputs[0].prompt_logprobs is not None and outputs[1].outputs[0].text
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    assert CompileCounter.count() == compiled
    assert runner.num_compiled_programs == programs
