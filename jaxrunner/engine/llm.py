"""``LLM``: the offline entry point, as vLLM's, for scripts and notebooks."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import cast

import jax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxrunner.config import (
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SamplerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jaxrunner.engine.data_parallel import DataParallelEngines
from jaxrunner.engine.kv_cache_manager import KVCacheManager
from jaxrunner.engine.llm_engine import LLMEngine
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.interfaces import RequestOutputKind, SamplingParams
from jaxrunner.models.builtin import DEFAULT_DTYPES, is_builtin
from jaxrunner.models.tokenizer import build_byte_tokenizer, load_tokenizer
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.sharding import make_mesh, replica_meshes

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]

# Limits sized for the backend: vLLM's H100/H200 offline defaults on a GPU;
# on a CPU, small limits and power-of-two ladders keep start-up short.
_GPU_LIMITS = dict(max_num_seqs=1024, max_num_batched_tokens=8192)
_CPU_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128)


def _power_of_two_ladder(limit: int) -> list[int]:
    return sorted({1 << i for i in range(limit.bit_length()) if 1 << i < limit} | {limit})


def _checkpoint_dtype(model_dir: str) -> str:
    """The dtype ``config.json`` names, if it is one we run, else bfloat16."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"


class LLM:
    """Generate text with a HuggingFace checkpoint directory or a built-in model.

    ``LLM("tiny-llama")`` runs the built-in tiny model (random weights, a
    byte-level tokenizer) with nothing to download. Keyword arguments set the
    engine: ``dtype`` ("auto" takes the checkpoint's), ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``gpu_memory_utilization``, ``num_gpu_blocks_override``, ``kv_cache_dtype``
    (vLLM's names: "auto", "bfloat16", "fp8"/"fp8_e4m3", "fp8_e5m2"...),
    ``calculate_kv_scales`` (an FP8 cache's scales from its first writes),
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``async_scheduling``
    (on: step k+1 is scheduled and dispatched while step k's tokens are on their
    way to the host), ``num_scheduler_steps`` (vLLM's multi-step scheduling: up
    to that many decode steps per round, in one device program, while every running
    request can end only at its length limit; 1, the default, turns it off),
    ``token_buckets``,
    ``request_buckets``, ``compilation_cache_dir``, ``compiler_options`` (XLA's
    options for the step programs; ``{}`` for XLA's defaults, see
    ``CompilationConfig``), ``max_logprobs``,
    ``logprobs_mode`` (vLLM's: raw_logprobs, raw_logits, processed_logprobs,
    processed_logits), ``speculative_config`` (e.g. ``{"method": "ngram",
    "num_speculative_tokens": 3}``) and ``seed``.

    ``tensor_parallel_size`` splits the model over that many devices;
    ``data_parallel_size`` runs that many independent engine replicas (each on
    ``tensor_parallel_size`` devices of its own) and spreads the prompts across
    them. ``llm_engine`` is the first replica.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = True,
        num_scheduler_steps: int = 1,
        token_buckets: list[int] | None = None,
        request_buckets: list[int] | None = None,
        compilation_cache_dir: str | None = None,
        compiler_options: dict[str, str | bool | int] | None = None,
        max_logprobs: int = 20,
        logprobs_mode: str = "raw_logprobs",
        speculative_config: SpeculativeConfig | dict | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        seed: int = 0,
    ):
        on_cpu = jax.default_backend() == "cpu"
        limits = _CPU_LIMITS if on_cpu else _GPU_LIMITS
        # None takes the device's default; 0 or less is refused (by SchedulerConfig, first), not replaced.
        scheduler_config = SchedulerConfig(
            max_num_seqs=limits["max_num_seqs"] if max_num_seqs is None else max_num_seqs,
            max_num_batched_tokens=(
                limits["max_num_batched_tokens"] if max_num_batched_tokens is None else max_num_batched_tokens
            ),
            enable_chunked_prefill=enable_chunked_prefill,
            async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps,
        )
        max_num_seqs, max_num_batched_tokens = scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens
        if on_cpu:
            token_buckets = token_buckets or _power_of_two_ladder(max_num_batched_tokens)
            request_buckets = request_buckets or _power_of_two_ladder(max_num_seqs)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
        meshes = replica_meshes(make_mesh(parallel))
        if is_builtin(model):
            dtype = DEFAULT_DTYPES[model] if dtype == "auto" else dtype
            self.tokenizer = build_byte_tokenizer()
        else:
            dtype = _checkpoint_dtype(model) if dtype == "auto" else dtype
            self.tokenizer = load_tokenizer(model)
        compilation = CompilationConfig(
            token_buckets=token_buckets, request_buckets=request_buckets, compiler_options=compiler_options
        )
        if compilation_cache_dir is not None:
            compilation.cache_dir = compilation_cache_dir
        config = RunnerConfig(
            model_config=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed),
            cache_config=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks_override=num_gpu_blocks_override,
                cache_dtype=kv_cache_dtype,
                calculate_kv_scales=calculate_kv_scales,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler_config=scheduler_config,
            compilation_config=compilation,
            sampler_config=SamplerConfig(max_logprobs=max_logprobs, logprobs_mode=logprobs_mode),
            parallel_config=parallel,
            speculative_config=(
                SpeculativeConfig(**speculative_config) if isinstance(speculative_config, dict) else speculative_config
            ),
        )
        self.config = config
        self.replicas = DataParallelEngines([self._make_engine(mesh, i) for i, mesh in enumerate(meshes)])
        self.llm_engine = self.replicas.engines[0]
        self.kv_cache_manager = self.llm_engine.scheduler.kv_cache_manager
        if not enable_chunked_prefill and self.llm_engine.max_model_len > max_num_batched_tokens:
            logger.warning(
                "Chunked prefill is off: prompts longer than max_num_batched_tokens (%d) can never be scheduled.",
                max_num_batched_tokens,
            )

    def _make_engine(self, mesh: Mesh, replica: int) -> LLMEngine:
        """One replica: a runner on ``mesh`` (model loaded, cache sized, buckets compiled), its cache
        manager and scheduler."""
        config = self.config
        runner = ModelRunner(config, mesh, replica)
        runner.load_model()
        num_blocks = runner.initialize_kv_cache()
        runner.capture_model()
        cache = config.cache_config
        manager = KVCacheManager(num_blocks, cache.block_size, enable_caching=cache.enable_prefix_caching)
        lookahead = config.num_speculative_tokens if config.uses_draft_model else 0
        scheduler = Scheduler(config.scheduler_config, manager, runner.max_model_len, lookahead)
        return LLMEngine(runner, scheduler, self.tokenizer)

    def get_tokenizer(self):
        """The tokenizer prompts are encoded and outputs decoded with."""
        return self.tokenizer

    def _add(self, prompts: Prompt | Sequence[Prompt], sampling_params) -> tuple[list[str], dict[str, RequestOutput]]:
        # One prompt (text, or token ids: ints) or several; an int first element does not narrow the type.
        batch: Sequence[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]
        else:
            batch = cast(Sequence[Prompt], prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(
                f"Got {len(sampling_params)} sampling params for {len(batch)} prompts; give one or one each."
            )
        replicas = self.replicas
        ids, refused = [], {}
        for prompt, params in zip(batch, sampling_params):
            request_id = replicas.next_request_id()
            ids.append(request_id)
            error = replicas.add_request(request_id, prompt, params)
            if error is not None:
                refused[request_id] = error
        return ids, refused

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        A prompt the engine refuses (empty, too long, bad parameters) gets a
        finished output whose ``error`` says why; the others still run.
        ``lora_request`` (vLLM's) is refused: LoRA adapters are not supported yet.
        """
        _refuse_lora(lora_request)
        ids, finished = self._add(prompts, sampling_params)
        pending = len(ids) - len(finished)
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, initial=len(finished)) as bar:
            while pending:
                for output in self.replicas.step(RequestOutputKind.FINAL_ONLY):
                    if output.finished:
                        finished[output.request_id] = output
                        pending -= 1
                        bar.update(1)
        return [finished[i] for i in ids]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: object | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield outputs as tokens arrive; each carries only the new text and token ids."""
        _refuse_lora(lora_request)
        ids, refused = self._add(prompts, sampling_params)
        yield from refused.values()
        pending = len(ids) - len(refused)
        while pending:
            for output in self.replicas.step(RequestOutputKind.DELTA):
                pending -= output.finished
                yield output

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered by the tokenizer's chat template."""
        _refuse_lora(lora_request)
        # One conversation (a list of messages) or several; a dict first element does not narrow the type.
        if messages and isinstance(messages[0], dict):
            conversations = [cast(list[dict[str, str]], messages)]
        else:
            conversations = cast(list[list[dict[str, str]]], messages)
        encoded = [
            self.tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # tokenize=True: token ids, in a BatchEncoding (a Mapping) where the tokenizer returns a dict.
        prompts: list[Prompt] = [
            list(p["input_ids"]) if isinstance(p, Mapping) else cast(list[int], list(p)) for p in encoded
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _refuse_lora(lora_request: object | None) -> None:
    """vLLM's ``lora_request`` argument, refused until LoRA adapters are supported."""
    if lora_request is not None:
        raise NotImplementedError(
            f"lora_request={lora_request!r}: LoRA adapters are not supported yet; call without lora_request."
        )
