"""ModelRunner end to end: HF greedy parity, no recompiles, seeded sampling, bad input."""

import random
from typing import TypedDict

import numpy as np
import pytest
import torch
import transformers
from hf_models import save_tiny_hf_model
from runner_driver import HandScheduler, make_runner

from jaxrunner.interfaces import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from jaxrunner.models import TransformerConfig, init_random_model, load_model
from jaxrunner.ops import AttentionBackend
from jaxrunner.runner.compilation import CompileCounter

GREEDY = SamplingParams(temperature=0.0)


class _Ladders(TypedDict):
    token_buckets: list[int]
    request_buckets: list[int]


SMALL_LADDERS = _Ladders(token_buckets=[8, 16, 32], request_buckets=[1, 2, 4])


def hf_greedy(path, prompt: list[int], num_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        # transformers types GenerationMixin's self as a Protocol (written for `ty`) that pyright finds
        # PreTrainedModel does not satisfy (hf_quantizer is declared, not set on the class).
        out = model.generate(  # pyright: ignore[reportAttributeAccessIssue]
            torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_match_transformers_generate(arch, tmp_path, cache_dir):
    """32 greedy tokens per prompt, prompts of different lengths, chunked prefill mixed with decodes."""
    save_tiny_hf_model(arch, tmp_path, seed=3)
    model, _ = load_model(tmp_path, dtype="float32")
    runner = make_runner(model, max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (5, 37, 17, 16)]
    scheduler = HandScheduler(runner, token_budget=24, max_chunk=13, seed=1)
    for i, prompt in enumerate(prompts):
        scheduler.add(f"r{i}", prompt, GREEDY, max_tokens=32)
    ours = scheduler.run()
    for i, prompt in enumerate(prompts):
        assert ours[f"r{i}"] == hf_greedy(tmp_path, prompt, 32), f"prompt {i} (len {len(prompt)})"


def _tiny_model():
    config = TransformerConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return init_random_model(config, dtype="float32", seed=0)


def test_no_recompile_over_random_steps(cache_dir):
    """After precompile (on four threads), 200 random steps (mixes, batch sizes, lengths) compile nothing."""
    runner = make_runner(
        _tiny_model(),
        max_num_seqs=6,
        max_num_batched_tokens=48,
        token_buckets=[4, 16, 48],
        request_buckets=[2, 6],
        cache_dir=cache_dir,
        compile_threads=4,
    )
    runner.capture_model()
    compiled_before, programs_before = CompileCounter.count(), runner.num_compiled_programs
    rng = random.Random(0)
    scheduler = HandScheduler(runner, token_budget=48, seed=2)
    sampling_choices = [GREEDY, SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.0, top_p=0.9)]
    steps, submitted = 0, 0
    while steps < 200:
        if rng.random() < 0.3 or not (scheduler.waiting or scheduler.running):
            for _ in range(rng.randint(1, 3)):
                prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
                scheduler.add(f"q{submitted}", prompt, rng.choice(sampling_choices), rng.randint(1, 20))
                submitted += 1
        scheduler.token_budget = rng.randint(1, 48)
        scheduler.step()
        steps += 1
    scheduler.token_budget = 48
    finished = scheduler.run()
    assert CompileCounter.count() == compiled_before
    assert runner.num_compiled_programs == programs_before
    assert len(finished) == submitted
    assert sorted(scheduler.free_blocks) == list(range(runner.num_blocks))


def test_nothing_compiles_after_warm_up_with_prompt_logprobs(cache_dir):
    """Prompt logprobs run precompiled programs too: asking for them after capture_model compiles nothing."""
    runner = make_runner(_tiny_model(), max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS)
    runner.capture_model()
    compiled_before, programs_before = CompileCounter.count(), runner.num_compiled_programs
    scheduler = HandScheduler(runner, token_budget=24, max_chunk=13, seed=3)
    rng = random.Random(4)
    for i in range(6):
        params = SamplingParams(temperature=0.0, prompt_logprobs=rng.choice([0, 2]), logprobs=rng.choice([None, 1]))
        scheduler.add(f"p{i}", [rng.randrange(1000) for _ in range(rng.randint(2, 40))], params, 4)
    assert len(scheduler.run()) == 6
    assert CompileCounter.count() == compiled_before
    assert runner.num_compiled_programs == programs_before


def test_runner_records_its_phases_as_spans(cache_dir):
    """Start-up and every step's phases are named spans; program calls and waits are read from them."""
    runner = make_runner(_tiny_model(), max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS)
    runner.capture_model()
    scheduler = HandScheduler(runner, token_budget=32)
    scheduler.add("a", [5, 6, 7], GREEDY, 3)
    scheduler.run()
    counts = runner.spans.counts
    for name in ("load_model", "initialize_kv_cache", "capture_model"):
        assert counts[name] == 1, name
    for name in ("execute_model", "prepare_inputs", "program_call", "sample_tokens", "get_output", "device_wait"):
        assert counts[name] >= 3, name
    assert runner.program_call_s == runner.spans.seconds["program_call"] > 0
    assert runner.device_wait_s == runner.spans.seconds["device_wait"] > 0


def test_the_attention_backend_is_resolved_once_from_the_mesh(monkeypatch):
    from jaxrunner.config import RunnerConfig
    from jaxrunner.envs import ATTENTION_IMPL_ENV_VAR
    from jaxrunner.runner.model_runner import ModelRunner

    monkeypatch.delenv(ATTENTION_IMPL_ENV_VAR, raising=False)
    assert ModelRunner(RunnerConfig()).attention_backend == AttentionBackend(None, hopper=False, interpret=True)
    monkeypatch.setenv(ATTENTION_IMPL_ENV_VAR, "mosaic_gpu")
    runner = ModelRunner(RunnerConfig())
    assert runner.attention_backend == AttentionBackend("mosaic_gpu", hopper=False, interpret=True)
    monkeypatch.setenv(ATTENTION_IMPL_ENV_VAR, "reference")  # read once: a later change does not reach it
    assert runner.attention_backend.impl == "mosaic_gpu"


def _run_alone_and_in_batch(seed_params: SamplingParams, cache_dir: str):
    model = _tiny_model()
    prompt = list(range(3, 20))
    alone = make_runner(
        model,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        token_buckets=[32, 64],
        request_buckets=[1, 8],
        cache_dir=cache_dir,
    )
    s = HandScheduler(alone, token_budget=64)
    s.add("x", prompt, seed_params, 12)
    tokens_alone = s.run()["x"]
    batched = make_runner(
        model,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        token_buckets=[32, 64],
        request_buckets=[1, 8],
        cache_dir=cache_dir,
    )
    s = HandScheduler(batched, token_budget=64, seed=5)
    rng = random.Random(1)
    for i in range(5):
        s.add(f"other{i}", [rng.randrange(1000) for _ in range(rng.randint(2, 9))], SamplingParams(temperature=1.0), 12)
    s.add("x", prompt, seed_params, 12)
    return tokens_alone, s.run()["x"]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.9, seed=1234), SamplingParams(temperature=1.3, top_k=50, top_p=0.8, seed=-7)],
)
def test_seeded_request_samples_the_same_alone_and_in_a_batch(params, cache_dir):
    alone, in_batch = _run_alone_and_in_batch(params, cache_dir)
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_different_seeds_give_different_samples(cache_dir):
    runner = make_runner(_tiny_model(), max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS)
    s = HandScheduler(runner, token_budget=32)
    for seed in range(4):
        s.add(f"s{seed}", [5, 6, 7], SamplingParams(temperature=1.0, seed=seed), 10)
    outs = s.run()
    assert len({tuple(v) for v in outs.values()}) == 4


def _new_request(req_id, prompt, block_ids, params=GREEDY):
    return NewRequestData(req_id, prompt, params, (block_ids,), 0)


def _schedule(new=(), tokens=None):
    tokens = tokens or {r.req_id: len(r.prompt_token_ids) for r in new}
    return SchedulerOutput(list(new), CachedRequestData(), tokens, sum(tokens.values()))


def test_prompt_longer_than_max_model_len_is_rejected(cache_dir):
    runner = make_runner(
        _tiny_model(), max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS
    )
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute_model(_schedule([_new_request("long", list(range(40)), [1, 2, 3])]))


def test_batch_past_the_largest_bucket_is_rejected(cache_dir):
    runner = make_runner(_tiny_model(), max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        runner.execute_model(_schedule([_new_request("big", list(range(40)), [1, 2, 3])]))


def test_unknown_request_is_rejected(cache_dir):
    runner = make_runner(_tiny_model(), max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir, **SMALL_LADDERS)
    so = SchedulerOutput([], CachedRequestData(["ghost"], [3], [None]), {"ghost": 1}, 1)
    with pytest.raises(ValueError, match="ghost"):
        runner.execute_model(so)


def test_a_round_of_decode_steps_refuses_what_it_cannot_run(cache_dir):
    """Several decode steps in one program take one token a step of plainly sampled, prefilled requests,
    in the rounds the runner was configured for."""
    runner = make_runner(
        _tiny_model(),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        cache_dir=cache_dir,
        num_scheduler_steps=2,
        **SMALL_LADDERS,
    )
    top_p = SamplingParams(temperature=1.0, top_p=0.5)
    new = [
        _new_request("plain", [5, 6, 7], [1]),
        _new_request("top_p", [5, 6, 8], [2], top_p),
        _new_request("long", list(range(9)), [3]),
    ]
    runner.execute_model(_schedule(new, {"plain": 3, "top_p": 3, "long": 4}))
    runner.sample_tokens()

    def round_of(tokens: dict[str, int], steps: int = 2) -> SchedulerOutput:
        cached = CachedRequestData(list(tokens), [0] * len(tokens), [None] * len(tokens))
        return SchedulerOutput([], cached, tokens, sum(tokens.values()), num_decode_steps=steps)

    with pytest.raises(ValueError, match="num_decode_steps is 4"):
        runner.execute_model(round_of({"plain": 4}, steps=4))
    with pytest.raises(ValueError, match="exactly 2 tokens"):
        runner.execute_model(round_of({"plain": 3}))
    with pytest.raises(ValueError, match="'long' is still prefilling"):
        runner.execute_model(round_of({"long": 2}))
    with pytest.raises(ValueError, match="'top_p' uses a sampling stage"):
        runner.execute_model(round_of({"plain": 2, "top_p": 2}))


def test_multi_step_scheduling_refuses_what_it_cannot_combine():
    from jaxrunner.config import CacheConfig, RunnerConfig, SchedulerConfig, SpeculativeConfig

    with pytest.raises(ValueError, match="num_scheduler_steps must be at least 1"):
        SchedulerConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="exceeds CacheConfig.block_size"):
        RunnerConfig(cache_config=CacheConfig(block_size=16), scheduler_config=SchedulerConfig(num_scheduler_steps=32))
    with pytest.raises(ValueError, match="speculative decoding or multi-step"):
        RunnerConfig(
            scheduler_config=SchedulerConfig(num_scheduler_steps=4),
            speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
        )
    assert SchedulerConfig(num_scheduler_steps=6).decode_step_counts == (1, 2, 4, 6)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", -3),
        ("min_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
