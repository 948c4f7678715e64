"""Drives a ModelRunner with hand-built SchedulerOutputs, for the runner tests.

A deliberately small scheduler: decodes first, then prefills chunked to a
token budget, KV blocks handed out from a shuffled free list (so block tables
are non-contiguous), requests finished after ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from jax.sharding import Mesh

from jaxrunner.config import (
    CacheConfig,
    CompilationConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.sharding import tensor_parallel_size


def make_runner(
    model,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    token_buckets: list[int] | None = None,
    request_buckets: list[int] | None = None,
    num_blocks: int = 128,
    block_size: int = 16,
    cache_dtype: str = "auto",
    calculate_kv_scales: bool = False,
    max_model_len: int = 256,
    cache_dir: str = "",
    mesh: Mesh | None = None,
    num_scheduler_steps: int = 1,
    compiler_options: dict | None = None,
    compile_threads: int = 1,
    lora_config: LoRAConfig | None = None,
) -> ModelRunner:
    """A runner with ``model`` loaded and its KV cache allocated; ``mesh`` as the model's for TP."""
    config = RunnerConfig(
        model_config=ModelConfig(max_model_len=max_model_len, dtype=str(model.dtype)),
        cache_config=CacheConfig(
            block_size=block_size,
            num_gpu_blocks_override=num_blocks,
            cache_dtype=cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_scheduler_steps=num_scheduler_steps,
        ),
        compilation_config=CompilationConfig(
            token_buckets=token_buckets,
            request_buckets=request_buckets,
            cache_dir=cache_dir,
            compiler_options=compiler_options,
            compile_threads=compile_threads,
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size(mesh)),
        lora_config=lora_config,
    )
    runner = ModelRunner(config, mesh)
    runner.load_model(model)
    runner.initialize_kv_cache()
    return runner


def tiny_llm(cache_dir: str, model: str = "tiny-llama", /, **overrides: Any) -> LLM:
    """``model``'s engine (the built-in tiny model by default) at the small limits and buckets the engine tests
    share, ``overrides`` on top."""
    limits: dict[str, Any] = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=200,
        token_buckets=[8, 64],
        request_buckets=[2, 4],
        compilation_cache_dir=cache_dir,
    )
    return LLM(model, **(limits | overrides))


@dataclasses.dataclass
class _Request:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    lora_request: Any = None
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    started: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class HandScheduler:
    """Continuous batching over a runner, with chunked prefill under a token budget; with ``max_loras``,
    a waiting request joins only while the running ones use at most that many distinct LoRA adapters."""

    def __init__(
        self,
        runner: ModelRunner,
        token_budget: int,
        seed: int = 0,
        max_chunk: int | None = None,
        max_loras: int | None = None,
    ):
        self.runner = runner
        self.token_budget = token_budget
        self.max_chunk = max_chunk
        self.max_loras = max_loras
        self.block_size = runner.block_size
        self.rng = random.Random(seed)
        self.free_blocks = list(range(runner.num_blocks))
        self.rng.shuffle(self.free_blocks)
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.finished: dict[str, list[int]] = {}
        self._to_free: set[str] = set()

    def add(
        self, req_id: str, prompt: list[int], params: SamplingParams, max_tokens: int, lora_request: Any = None
    ) -> None:
        self.waiting.append(_Request(req_id, list(prompt), params, max_tokens, lora_request))

    def _fits_loras(self, req: _Request) -> bool:
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return (
            self.max_loras is None
            or req.lora_request is None
            or req.lora_request.lora_int_id in adapters
            or len(adapters) < self.max_loras
        )

    def _grow(self, req: _Request, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        new = [self.free_blocks.pop() for _ in range(max(need, 0))]
        req.blocks += new
        return new

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        num_scheduled: dict[str, int] = {}
        new_reqs, cached = [], CachedRequestData()
        max_reqs = self.runner.max_num_reqs
        for req in list(self.waiting):
            if len(self.running) < max_reqs and self._fits_loras(req):
                self.waiting.remove(req)
                self.running.append(req)
        # Decodes first, then prefill chunks, as vLLM orders them.
        order = sorted(self.running, key=lambda r: r.num_computed < len(r.prompt))
        for req in order:
            if budget == 0:
                break
            remaining = req.num_tokens - req.num_computed
            chunk = min(remaining, budget, self.max_chunk or remaining)
            new_blocks = self._grow(req, req.num_computed + chunk)
            if not req.started:
                new_reqs.append(
                    NewRequestData(
                        req.req_id,
                        req.prompt,
                        req.params,
                        (list(req.blocks),),
                        req.num_computed,
                        lora_request=req.lora_request,
                    )
                )
                req.started = True
            else:
                cached.req_ids.append(req.req_id)
                cached.num_computed_tokens.append(req.num_computed)
                cached.new_block_ids.append((new_blocks,) if new_blocks else None)
            num_scheduled[req.req_id] = chunk
            budget -= chunk
        finished, self._to_free = self._to_free, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
        )

    def step(self) -> None:
        scheduler_output = self.schedule()
        self.runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return
        output = self.runner.sample_tokens(None)
        assert isinstance(output, ModelRunnerOutput)  # make_runner leaves async scheduling off
        by_id = {r.req_id: r for r in self.running}
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            req = by_id[req_id]
            req.num_computed += scheduler_output.num_scheduled_tokens[req_id]
            req.output += tokens
            if len(req.output) >= req.max_tokens:
                self.running.remove(req)
                self.free_blocks += req.blocks
                self.finished[req_id] = req.output
                self._to_free.add(req_id)

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                self.runner.execute_model(self.schedule())  # deliver the last finished ids
                return self.finished
            self.step()
        raise RuntimeError("requests did not finish")
