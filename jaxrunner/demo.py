"""The main job on the built-in tiny model: a batch of prompts through the runner.

A randomly initialised Llama-shaped model (no checkpoint needed) serves a few
prompts of token ids: one prefill step for all of them, then greedy decode
steps, each a hand-built ``SchedulerOutput`` as a scheduler would send.
"""

from __future__ import annotations

import time

import numpy as np

from jaxrunner.config import CacheConfig, CompilationConfig, ModelConfig, RunnerConfig, SchedulerConfig
from jaxrunner.interfaces import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from jaxrunner.model_runner import ModelRunner
from jaxrunner.models import TransformerConfig, init_random_model

TINY_MODEL = TransformerConfig(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
)


def run_demo(num_prompts: int = 4, prompt_len: int = 24, max_tokens: int = 32, seed: int = 0) -> dict[str, list[int]]:
    """Generate ``max_tokens`` greedy tokens for ``num_prompts`` random prompts; print a summary."""
    config = RunnerConfig(
        model_config=ModelConfig(dtype="float32", max_model_len=prompt_len + max_tokens),
        cache_config=CacheConfig(num_gpu_blocks_override=num_prompts * 8 + 8),
        scheduler_config=SchedulerConfig(max_num_seqs=num_prompts, max_num_batched_tokens=num_prompts * prompt_len),
        compilation_config=CompilationConfig(
            token_buckets=[num_prompts, num_prompts * prompt_len], request_buckets=[num_prompts]
        ),
    )
    runner = ModelRunner(config)
    runner.load_model(init_random_model(TINY_MODEL, dtype="float32", seed=seed))
    runner.initialize_kv_cache()
    compile_s = runner.capture_model()

    rng = np.random.default_rng(seed)
    blocks_per_req = -(-(prompt_len + max_tokens) // runner.block_size)
    req_ids = [f"prompt-{i}" for i in range(num_prompts)]
    prompts = {r: rng.integers(0, TINY_MODEL.vocab_size, prompt_len).tolist() for r in req_ids}
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    new_reqs = [
        NewRequestData(r, prompts[r], greedy, (list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),), 0)
        for i, r in enumerate(req_ids)
    ]
    outputs: dict[str, list[int]] = {r: [] for r in req_ids}
    start = time.perf_counter()
    step = SchedulerOutput(new_reqs, CachedRequestData(), {r: prompt_len for r in req_ids}, num_prompts * prompt_len)
    for i in range(max_tokens):
        runner.execute_model(step)
        result = runner.sample_tokens(None)
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            outputs[req_id] += tokens
        computed = [prompt_len + i] * num_prompts
        cached = CachedRequestData(list(req_ids), computed, [None] * num_prompts)
        step = SchedulerOutput([], cached, {r: 1 for r in req_ids}, num_prompts)
    elapsed = time.perf_counter() - start
    for req_id in req_ids:
        print(f"{req_id}: {prompts[req_id][:8]}... -> {outputs[req_id]}")
    total = num_prompts * max_tokens
    print(f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s "
          f"(precompile {compile_s:.1f} s, {runner.num_compiled_programs} programs)")
    return outputs
