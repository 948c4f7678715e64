"""``LLM``: the offline entry point, as vLLM's, for scripts and notebooks."""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import transformers
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxrunner.config import (
    CacheConfig,
    CompilationConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    RunnerConfig,
    SamplerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from jaxrunner.engine.chat import chat_messages
from jaxrunner.engine.data_parallel import DataParallelEngines
from jaxrunner.engine.encoder_cache_manager import EncoderCacheManager
from jaxrunner.engine.input_processor import PreparedPrompt
from jaxrunner.engine.kv_cache_manager import KVCacheManager
from jaxrunner.engine.llm_engine import LLMEngine
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.engine.prompts import ParsedPrompt, PromptType, TokensPrompt, as_prompt_list, parse_prompt
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.interfaces import RequestOutputKind, SamplingParams
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models.builtin import DEFAULT_DTYPES, check_model_name, is_builtin
from jaxrunner.models.loader import load_config
from jaxrunner.models.safetensors_io import CONFIG_FILE, read_json_object
from jaxrunner.models.tokenizer import build_byte_tokenizer, load_tokenizer
from jaxrunner.multimodal.processing import MultiModalProcessor
from jaxrunner.runner.compilation import power_of_two_ladder
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.sharding import make_mesh, replica_meshes

logger = logging.getLogger(__name__)

# Limits sized for the backend: vLLM's H100/H200 offline defaults on a GPU;
# on a CPU, small limits and power-of-two ladders keep start-up short.
_GPU_LIMITS = dict(max_num_seqs=1024, max_num_batched_tokens=8192)
_CPU_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128)


class _NewRequest(NamedTuple):
    """One prompt of a call, checked for its form and given its request id."""

    request_id: str
    prompt: ParsedPrompt
    params: SamplingParams
    lora_request: LoRARequest | None


def _checkpoint_dtype(model_dir: str) -> str:
    """The dtype ``config.json`` names, if it is one we run, else bfloat16."""
    config = read_json_object(Path(model_dir) / CONFIG_FILE)
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
    ``quantization`` ("fp8": the decoder's weights in FP8, quantized as they load
    where the checkpoint's are not; FP8 checkpoints load as FP8 without it),
    ``calculate_kv_scales`` (an FP8 cache's scales from its first writes),
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``async_scheduling``
    (on: step k+1 is scheduled and dispatched while step k's tokens are on their
    way to the host), ``num_scheduler_steps`` (vLLM's multi-step scheduling: up
    to that many decode steps per round, in one device program, while every running
    request can end only at its length limit; 1, the default, turns it off),
    ``disable_hybrid_kv_cache_manager`` (full-length caches for sliding-window
    layers too, as vLLM's), ``token_buckets``,
    ``request_buckets``, ``compilation_cache_dir``, ``compiler_options`` (XLA's
    options for the step programs; ``{}`` for XLA's defaults, see
    ``CompilationConfig``), ``compile_threads`` (programs XLA compiles at once while
    precompiling; 1 by default), ``max_logprobs``,
    ``logprobs_mode`` (vLLM's: raw_logprobs, raw_logits, processed_logprobs,
    processed_logits), ``speculative_config`` (e.g. ``{"method": "ngram",
    "num_speculative_tokens": 3}``) and ``seed``. ``skip_tokenizer_init=True``
    loads no tokenizer (a checkpoint may have none): prompts must then be
    token ids, outputs carry token ids and empty text, and no EOS token is known
    (as vLLM's; set ``stop_token_ids`` to stop on one).

    ``enable_lora=True`` serves LoRA adapters in PEFT's format, as vLLM's: a call's
    ``lora_request`` (a ``LoRARequest``, ``jaxrunner.lora.request``) runs every prompt
    with that adapter, or a list of one per prompt (None: the base model). One
    step mixes at most ``max_loras`` adapters (the adapters' device slots; prompts
    of others wait their turn); ``max_lora_rank`` is the largest rank an adapter
    may have; ``max_cpu_loras`` adapters stay read in host memory (None:
    ``max_loras``). An adapter that cannot be read or does not fit the model is
    refused for its prompts alone, with an error output naming it.

    A vision-language checkpoint (Qwen2-VL, Qwen2.5-VL) takes images, as vLLM's:
    ``{"prompt": text, "multi_modal_data": {"image": image_or_list}}`` with one
    ``<|vision_start|><|image_pad|><|vision_end|>`` in the text per image, or image
    parts in ``chat``. Images are PIL images, uint8 arrays, local paths or
    ``file://`` / ``data:`` URLs, preprocessed by the checkpoint's image processor
    (``mm_processor_kwargs`` overrides its settings, e.g. ``{"max_pixels": ...}``);
    ``limit_mm_per_prompt`` caps the images of one prompt (``{"image": 4}``; 999
    unless set); ``patch_buckets`` are the patch counts the image encoder compiles
    for (None: two a octave up to the largest image the processor makes). An image
    that cannot be read, is too large or too many is refused for its prompt alone.

    ``kv_transfer_config`` (a ``KVTransferConfig`` or its fields as a dict) connects
    the KV cache to a store outside the device, as vLLM's: ``{"kv_connector":
    "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": n}}``
    keeps computed blocks in host memory and loads a prefix the device evicted
    instead of computing it again; ``{"kv_connector": "SharedStorageConnector",
    "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config":
    {"shared_storage_path": dir}}`` hands prompts' KV from a prefill engine to a
    decode engine through files. ``llm.llm_engine.runner.kv_connector.stats``
    counts what moved and what failed (a failed load computes the tokens).

    A prompt is text, token ids (Python or NumPy integers, or a 1-D integer
    array) or vLLM's ``TextPrompt`` / ``TokensPrompt`` dict (``jaxrunner.inputs``);
    a call takes one prompt or a list of them. A prompt of the wrong form fails
    the whole call before any of its prompts runs. One call asks for at most
    ``max_sequences_per_call`` sequences (``SamplingParams.n`` summed over its
    prompts): a typo such as ``n=10**9`` fails at once instead of exhausting
    the host's memory; split larger batches across calls, or raise the limit.

    Every call leaves the engine ready for the next whatever ends it: an
    exception or KeyboardInterrupt (a notebook's interrupt) aborts the call's
    prompts, as does closing a ``stream`` early; the next call returns what a
    fresh engine would.

    ``tensor_parallel_size`` splits the model over that many devices;
    ``data_parallel_size`` runs that many independent engine replicas (each on
    ``tensor_parallel_size`` devices of its own) and spreads the prompts across
    them. ``llm_engine`` is the first replica.
    """

    max_sequences_per_call: int = 1 << 20
    """The most sequences one call may ask for (the sum of ``SamplingParams.n`` over its prompts)."""

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
        quantization: str | None = None,
        calculate_kv_scales: bool = False,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = True,
        num_scheduler_steps: int = 1,
        disable_hybrid_kv_cache_manager: bool = False,
        token_buckets: list[int] | None = None,
        request_buckets: list[int] | None = None,
        compilation_cache_dir: str | None = None,
        compiler_options: dict[str, str | bool | int] | None = None,
        compile_threads: int = 1,
        max_logprobs: int = 20,
        logprobs_mode: str = "raw_logprobs",
        speculative_config: SpeculativeConfig | dict | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        patch_buckets: list[int] | None = None,
        kv_transfer_config: KVTransferConfig | dict | None = None,
    ):
        check_model_name(model)  # before anything is built: a misspelled name or a hub id gets the built-in names
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
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        )
        max_num_seqs, max_num_batched_tokens = scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens
        if on_cpu:
            token_buckets = token_buckets or power_of_two_ladder(max_num_batched_tokens)
            request_buckets = request_buckets or power_of_two_ladder(max_num_seqs)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
        meshes = replica_meshes(make_mesh(parallel))
        if is_builtin(model):
            dtype = DEFAULT_DTYPES[model] if dtype == "auto" else dtype
        else:
            dtype = _checkpoint_dtype(model) if dtype == "auto" else dtype
        self.tokenizer = None
        if not skip_tokenizer_init:
            self.tokenizer = build_byte_tokenizer() if is_builtin(model) else load_tokenizer(model)
        compilation = CompilationConfig(
            token_buckets=token_buckets,
            request_buckets=request_buckets,
            patch_buckets=patch_buckets,
            compiler_options=compiler_options,
            compile_threads=compile_threads,
        )
        if compilation_cache_dir is not None:
            compilation.cache_dir = compilation_cache_dir
        config = RunnerConfig(
            model_config=ModelConfig(
                model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, quantization=quantization
            ),
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
            lora_config=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
            multimodal_config=MultiModalConfig(dict(limit_mm_per_prompt or {}), dict(mm_processor_kwargs or {})),
            kv_transfer_config=(
                KVTransferConfig(**kv_transfer_config) if isinstance(kv_transfer_config, dict) else kv_transfer_config
            ),
        )
        self.config = config
        # A vision-language model's image processor, which bounds the images the runners compile for.
        self.mm_processor: MultiModalProcessor | None = None
        if not is_builtin(model):
            arch = load_config(model)
            if arch.vision is not None:
                self.mm_processor = MultiModalProcessor.from_checkpoint(model, arch, config.multimodal_config)
                config.multimodal_config.max_tokens_per_image = self.mm_processor.max_tokens_per_image
        self.replicas = DataParallelEngines([self._make_engine(mesh, i) for i, mesh in enumerate(meshes)])
        self.llm_engine = self.replicas.engines[0]
        self.kv_cache_manager = self.llm_engine.scheduler.kv_cache_manager
        # The outputs waiting for each running call, by the request ids of its prompts.
        self._inboxes: dict[str, collections.deque[RequestOutput]] = {}
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
        manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            windows=runner.kv_cache_groups.windows,
        )
        logger.info(
            "Maximum concurrency for %d tokens per request: %.2fx (%d KV-cache groups)",
            runner.max_model_len,
            manager.max_concurrency(runner.max_model_len, config.scheduler_config.max_num_batched_tokens),
            manager.num_groups,
        )
        lookahead = config.num_speculative_tokens if config.uses_draft_model else 0
        max_loras = config.lora_config.max_loras if config.lora_config is not None else None
        encoder_cache, encoder_budget = None, 0
        if runner.encoder_runner is not None:
            encoder_budget, cache_size = config.scheduler_config.encoder_budget(runner.max_model_len)
            encoder_cache = EncoderCacheManager(cache_size)
        scheduler = Scheduler(
            config.scheduler_config,
            manager,
            runner.max_model_len,
            lookahead,
            max_loras,
            encoder_cache_manager=encoder_cache,
            encoder_compute_budget=encoder_budget,
            kv_connector=runner.kv_connector if runner.uses_kv_connector else None,
        )
        return LLMEngine(runner, scheduler, self.tokenizer, self.mm_processor)

    def save_converted(self, out_dir: str) -> None:
        """Write the model as the engine holds it (merged projections, padded for its mesh, each array in its
        sharding) with orbax-checkpoint, beside the checkpoint's config and tokenizer files: ``LLM(model=out_dir,
        ...)`` with the same dtype and tensor_parallel_size then restores it onto the devices without
        re-reading or re-merging the safetensors."""
        self.llm_engine.runner.save_converted(out_dir)

    def get_tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """The tokenizer prompts are encoded and outputs decoded with; ValueError with
        ``skip_tokenizer_init`` (as vLLM's)."""
        if self.tokenizer is None:
            raise ValueError("This LLM has no tokenizer: it was made with skip_tokenizer_init=True.")
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``lora_request``: the LoRA adapter of every prompt, or a list of one per
        prompt (None: the base model). A prompt the engine refuses (empty, too
        long, token ids outside the vocabulary, bad parameters, an adapter that
        cannot be read or does not fit the model) gets a finished output whose
        ``error`` says why; the others still run.
        """
        requests = self._new_requests(prompts, sampling_params, lora_request)
        finished: dict[str, RequestOutput] = {}
        with (
            tqdm(total=len(requests), desc="Generating", disable=not use_tqdm) as bar,
            contextlib.closing(self._run(requests, RequestOutputKind.FINAL_ONLY)) as outputs,
        ):
            for output in outputs:
                finished[output.request_id] = output
                bar.update(1)
        return [finished[r.request_id] for r in requests]

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Generator[RequestOutput, None, None]:
        """Yield outputs as tokens arrive; each carries only the new text and token ids.

        The prompts are checked now and run as the iterator is read. Closing it
        early (``break``, ``close()``, dropping it) aborts the prompts it has not
        finished; ``llm_engine.abort_request`` on one of its prompts ends that
        prompt with a last output whose finish reason is "abort".
        """
        requests = self._new_requests(prompts, sampling_params, lora_request)
        return self._stream(requests)

    def _stream(self, requests: list[_NewRequest]) -> Generator[RequestOutput, None, None]:
        with contextlib.closing(self._run(requests, RequestOutputKind.DELTA)) as outputs:
            yield from outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered by the tokenizer's chat template; ``lora_request``
        as ``generate``'s, one per conversation if a list.

        A message's content is text or, as in OpenAI's API, a list of parts: ``{"type": "text", "text":
        ...}``, and for a vision-language model images as ``{"type": "image_url", "image_url": {"url":
        ...}}`` (a local path, ``file://`` or ``data:`` URL) or ``{"type": "image_pil", "image_pil":
        image}``. The template renders each image as the model's placeholder, and the images go with the
        prompt as its ``multi_modal_data``.
        """
        if self.tokenizer is None:
            raise ValueError(
                "LLM.chat renders conversations with the tokenizer's chat template, and this LLM has no "
                "tokenizer (skip_tokenizer_init=True): render them yourself and generate from token ids."
            )
        # One conversation (a list of messages) or several; a dict first element does not narrow the type.
        if messages and isinstance(messages[0], dict):
            conversations = [cast(list[dict], messages)]
        else:
            conversations = cast(list[list[dict]], messages)
        prompts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            rendered, images = chat_messages(conversation, f"conversation {i}")
            encoded = self.tokenizer.apply_chat_template(
                rendered, tokenize=True, add_generation_prompt=add_generation_prompt
            )
            # tokenize=True: token ids, in a BatchEncoding (a Mapping) where the tokenizer returns a dict.
            ids = list(encoded["input_ids"]) if isinstance(encoded, Mapping) else cast(list[int], list(encoded))
            prompt: TokensPrompt = {"prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ------------------------------------------------------------ requests

    def _new_requests(
        self,
        prompts: object,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: object,
    ) -> list[_NewRequest]:
        """The call's prompts checked for their form, with their parameters, adapters and request ids;
        raises (naming the prompt) before any prompt reaches the engine if one cannot be taken."""
        parsed = [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(as_prompt_list(prompts))]
        if self.tokenizer is None:
            for i, prompt in enumerate(parsed):
                if prompt.token_ids is None:
                    raise ValueError(
                        f"prompts[{i}] is text, but this LLM has no tokenizer (skip_tokenizer_init=True): "
                        "pass token ids ({'prompt_token_ids': [...]}) or drop skip_tokenizer_init."
                    )
        params = self._params_per_prompt(sampling_params, len(parsed))
        loras = self._loras_per_prompt(lora_request, len(parsed))
        num_sequences = sum(p.n for p in params if isinstance(p, SamplingParams) and isinstance(p.n, int))
        if num_sequences > self.max_sequences_per_call:
            raise ValueError(
                f"This call asks for {num_sequences} sequences (SamplingParams.n summed over its prompts), more "
                f"than LLM.max_sequences_per_call ({self.max_sequences_per_call}): split the prompts across "
                "calls, or raise llm.max_sequences_per_call."
            )
        return [_NewRequest(self.replicas.next_request_id(), p, sp, lora) for p, sp, lora in zip(parsed, params, loras)]

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        """One ``SamplingParams`` for each prompt: the given one (the defaults if None) for all, or one each."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            return [cast(SamplingParams, sampling_params)] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"Got {len(sampling_params)} sampling params for {num_prompts} prompts; give one or one each."
            )
        return list(sampling_params)

    def _loras_per_prompt(self, lora_request: object, num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (None: the base model) for each prompt: the given one for all, or one each
        (vLLM's forms); refused if LoRA is off and any is given."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != num_prompts:
                raise ValueError(
                    f"Got {len(lora_request)} LoRA requests for {num_prompts} prompts; give one for all, "
                    "or one each (None: the base model)."
                )
            named = [(f"lora_request[{i}]", lora) for i, lora in enumerate(lora_request)]
        else:
            named = [("lora_request", lora_request)] * num_prompts
        for where, lora in named:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise ValueError(
                    f"{where} must be a LoRARequest (from jaxrunner.lora.request import LoRARequest) or None; "
                    f"got {type(lora).__name__}."
                )
        loras = [cast(LoRARequest | None, lora) for _, lora in named]
        if self.config.lora_config is None and any(lora is not None for lora in loras):
            raise ValueError(
                "Got a lora_request, but LoRA is off in this LLM: make it with LLM(..., enable_lora=True), "
                "with max_loras and max_lora_rank as your adapters need."
            )
        return loras

    def _run(self, requests: list[_NewRequest], output_kind: RequestOutputKind) -> Generator[RequestOutput, None, None]:
        """Queue the call's prompts, then step the engines until every one has finished, yielding its
        outputs as they come (refused prompts' error outputs first).

        However it ends (done, an exception, KeyboardInterrupt, closed early), the
        call's unfinished prompts are aborted and an idle engine holds nothing. Prompts
        that no running call waits for (left by a call that could not clean up, or
        added to ``llm_engine`` directly) are aborted first.
        """
        ids = [r.request_id for r in requests]
        inbox: collections.deque[RequestOutput] = collections.deque()
        try:
            self._abort_orphans()
            for request_id in ids:
                self._inboxes[request_id] = inbox
            inbox.extend(self._add(requests, output_kind))
            pending = len(ids)
            while pending:
                if not inbox:
                    self._step()
                    continue
                output = inbox.popleft()
                pending -= output.finished
                yield output
        finally:
            for request_id in ids:
                self._inboxes.pop(request_id, None)
            self.replicas.abort_request(ids, internal=True)

    def _abort_orphans(self) -> None:
        orphans = [i for i in self.replicas.unfinished_prompt_ids if i not in self._inboxes]
        if orphans:
            logger.warning("Aborting %d prompts that no call waits for.", len(orphans))
            self.replicas.abort_request(orphans, internal=True)

    def _add(self, requests: list[_NewRequest], output_kind: RequestOutputKind) -> list[RequestOutput]:
        """Queue the call's prompts, all or none: every prompt is checked and made into its requests
        before the first is queued. Returns the error outputs of the prompts the engine refused."""
        prepared: list[tuple[LLMEngine, PreparedPrompt]] = []
        refused: list[RequestOutput] = []
        try:
            for request, engine in zip(requests, self.replicas.assign(len(requests))):
                result = engine.prepare_request(*request)
                if isinstance(result, RequestOutput):
                    refused.append(result)
                else:
                    prepared.append((engine, result))
            for engine, prompt in prepared:
                engine.add_prepared(prompt, output_kind)
        except BaseException:
            for engine, prompt in prepared:  # the ones queued already are aborted by the caller
                engine.discard(prompt)
            raise
        return refused

    def _step(self) -> None:
        """One step of the engines; each output goes to the inbox of the call that added its prompt."""
        if not self.replicas.has_unfinished_requests():
            raise RuntimeError("A call's prompts left the engine without a final output (aborted with internal=True?).")
        for output in self.replicas.step():
            inbox = self._inboxes.get(output.request_id)
            if inbox is not None:
                inbox.append(output)
