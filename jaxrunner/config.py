"""Configuration dataclasses, grouped as vLLM groups them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxrunner import envs


@dataclasses.dataclass
class ModelConfig:
    """Which model to run and in which precision.

    ``model`` is a HuggingFace checkpoint directory. ``max_model_len`` defaults
    to the checkpoint's ``max_position_embeddings``. ``quantization`` is vLLM's:
    ``"fp8"`` holds the decoder's Linears in FP8, quantizing them as they load where
    the checkpoint's are not (``models/quantization.py``); None: as the checkpoint has them.
    """

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"ModelConfig.dtype must be 'bfloat16', 'float16' or 'float32'; got {self.dtype!r}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"ModelConfig.max_model_len must be positive; got {self.max_model_len}.")


CACHE_DTYPES = {
    "auto": None,
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""vLLM's ``kv_cache_dtype`` names and the dtype each stores ("auto": the model's)."""


@dataclasses.dataclass
class CacheConfig:
    """The paged KV cache.

    ``cache_dtype`` is one of :data:`CACHE_DTYPES` (vLLM's names). An FP8 cache
    stores every K (V) value as ``value / k_scale`` (``v_scale``), saturated to
    the format's range, with one scale per layer: the checkpoint's, else 1.0;
    ``calculate_kv_scales`` (vLLM's option) instead sets each layer's from the
    first keys and values it writes (``max|k| / 200``, ``max|v| / 100``), once.

    ``gpu_memory_utilization`` is vLLM's: the fraction of each device's total
    memory the engine may use. The KV cache gets that, less what is in use once
    the model is loaded, less the activation peak of the largest steps (the
    profile run runs them once), less ``runner.kv_cache.KV_CACHE_MARGIN_BYTES``;
    ``ModelRunner.memory_budget`` records the figures. JAX's memory pool must
    hold it: importing jaxrunner sizes the pool at 0.95 of each GPU unless
    ``XLA_CLIENT_MEM_FRACTION`` is set (``envs.size_gpu_memory_pool``). On
    backends that report no memory statistics (the CPU) the cache gets
    ``cpu_kv_cache_bytes``. ``num_gpu_blocks_override`` fixes the number of blocks instead.
    """

    block_size: int = 16
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"CacheConfig.block_size must be a power of two; got {self.block_size}.")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"CacheConfig.cache_dtype (kv_cache_dtype) {self.cache_dtype!r} is not one of "
                f"{', '.join(map(repr, CACHE_DTYPES))} ('auto': the model's dtype; 'fp8' is 'fp8_e4m3')."
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"CacheConfig.gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                "CacheConfig.num_gpu_blocks_override must be at least 2 (block 0 is "
                f"reserved for padding); got {self.num_gpu_blocks_override}."
            )


@dataclasses.dataclass
class SchedulerConfig:
    """Batch limits per step (vLLM's dataclass defaults); long prompts are chunked across steps.

    ``async_scheduling`` (vLLM's name) schedules and dispatches step k+1 before
    step k's sampled tokens reach the host, so host work overlaps device work:
    the runner's ``sample_tokens`` then returns an ``AsyncModelRunnerOutput``.
    Off here, as in vLLM, so a runner driven by hand answers plainly; ``LLM``
    turns it on. The engine falls back to one step at a time while a request
    needs its tokens first (drafts proposed on the host, structured outputs).

    ``num_scheduler_steps`` (vLLM's multi-step scheduling) lets one scheduling
    round run up to that many decode steps back to back in one device program,
    so the host's work per step (scheduling, packing, output handling) is paid
    once for all of them. It applies only while every running request is decoding
    and can end only at its length limit, and no waiting request could be
    admitted; otherwise the step is a single one. Counts below the maximum are
    powers of two (:meth:`decode_step_counts`); each is a program per bucket that
    unrolls that many steps, so precompiling takes about 2 + 4 + ... + K forward
    steps' compile time more per bucket. At most ``CacheConfig.block_size``.

    ``disable_hybrid_kv_cache_manager`` (vLLM's name) keeps one KV-cache group of
    full-length caches for a model that mixes sliding-window and full attention,
    instead of a group per kind whose sliding groups hold only their window.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    num_scheduler_steps: int = 1
    disable_hybrid_kv_cache_manager: bool = False
    # Vision-language models (vLLM's names): encoder outputs a step may compute, and the encoder cache's
    # size, both in embeddings (placeholder tokens). None: the larger of max_num_batched_tokens and
    # max_model_len, so that any image that fits a prompt can be encoded.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be positive; got {value}.")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"SchedulerConfig.num_scheduler_steps must be at least 1; got {self.num_scheduler_steps}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be positive; got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens must be positive; got {self.max_num_batched_tokens}."
            )

    def encoder_budget(self, max_model_len: int) -> tuple[int, int]:
        """(Embeddings the encoder may compute in one step, embeddings the encoder cache holds): the configured
        values, or by default the larger of ``max_num_batched_tokens`` and ``max_model_len``, so that any
        image that fits a prompt fits both."""
        default = max(self.max_num_batched_tokens, max_model_len)
        return self.max_num_encoder_input_tokens or default, self.encoder_cache_size or default

    @property
    def decode_step_counts(self) -> tuple[int, ...]:
        """Decode steps one round may run: the powers of two below ``num_scheduler_steps``, and it."""
        most = self.num_scheduler_steps
        return tuple(sorted({most} | {2**i for i in range(most.bit_length()) if 2**i < most}))


@dataclasses.dataclass
class SamplerConfig:
    """Static capacities of the on-device sampler state, per request.

    ``logprobs_mode`` is vLLM's: "raw_logprobs" (the model's), "raw_logits",
    "processed_logprobs" or "processed_logits" (after penalties, temperature,
    min-p, top-k and top-p: the distribution sampled from).
    """

    max_logprobs: int = 20
    max_logit_bias: int = 64
    max_stop_token_ids: int = 16
    max_bad_words: int = 16
    max_bad_word_len: int = 8
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        modes = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
        if self.logprobs_mode not in modes:
            raise ValueError(f"SamplerConfig.logprobs_mode must be one of {modes}; got {self.logprobs_mode!r}.")
        for name in ("max_logprobs", "max_logit_bias", "max_stop_token_ids", "max_bad_words", "max_bad_word_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SamplerConfig.{name} must be positive; got {getattr(self, name)}.")


@dataclasses.dataclass
class SpeculativeConfig:
    """Speculative decoding: who proposes drafts and how many per step.

    ``method`` "ngram" proposes by prompt lookup: the tokens that followed the
    earlier occurrence of the history's last ``prompt_lookup_min``..``max`` tokens,
    on the host, so one step at a time (as vLLM, async scheduling is off with it);
    "ngram_gpu" (vLLM's name) proposes the same drafts on the device, and runs
    under async scheduling.
    "draft_model" decodes the drafts greedily with ``model`` (a checkpoint
    directory or built-in name of the target's vocabulary) on the device;
    "eagle" with the EAGLE head checkpoint ``model``, fed the target's features.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "ngram_gpu", "draft_model", "eagle"):
            raise ValueError(
                f"SpeculativeConfig.method must be 'ngram', 'ngram_gpu', 'draft_model' or 'eagle'; got {self.method!r}."
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens must be positive; got {self.num_speculative_tokens}."
            )


@dataclasses.dataclass
class LoRAConfig:
    """Multi-LoRA serving, with vLLM's names (``LLM(enable_lora=True, ...)``).

    ``max_loras`` adapters sit in device slots at once, so one step mixes at most
    that many (besides the base model); ``max_lora_rank`` is the largest rank an
    adapter may have (smaller ones are zero-padded to it); ``max_cpu_loras``
    adapters are kept read in host memory (least recently used dropped first;
    None: ``max_loras``).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoRAConfig.{name} must be positive; got {getattr(self, name)}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"LoRAConfig.max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                "every adapter on the device is also kept in host memory."
            )


@dataclasses.dataclass
class ParallelConfig:
    """How many devices serve the model, with vLLM's names.

    ``tensor_parallel_size`` devices share one copy of the model (Megatron-style:
    attention heads, MLP features and the vocabulary are split among them);
    ``data_parallel_size`` such groups each run an independent engine replica,
    and requests are spread across the replicas.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be positive; got {getattr(self, name)}.")

    @property
    def world_size(self) -> int:
        """Devices used in all: one mesh row of ``tensor_parallel_size`` per replica."""
        return self.tensor_parallel_size * self.data_parallel_size


def default_cache_dir() -> str:
    """The persistent compilation cache of a ``CompilationConfig`` given none: ``JAXRUNNER_COMPILATION_CACHE_DIR``'s
    directory, else none (``""``): JAX keeps one cache per process, for the user's own programs too, so it is
    turned on only at the user's word."""
    return envs.JAXRUNNER_COMPILATION_CACHE_DIR or ""


def user_cache_dir() -> str:
    """``$XDG_CACHE_HOME/jaxrunner/xla`` (``~/.cache`` without it): where the jaxrunner command keeps its programs."""
    return os.path.join(envs.XDG_CACHE_HOME, "jaxrunner", "xla")


# Step programs of at least this many rows take cuBLAS for their matmuls, fewer XLA's own GEMMs: each
# ran the decode step faster on its side (``benchmarks/decisions/cublas_from_64_rows.md``).
CUBLAS_MIN_ROWS = 64
CUBLAS_GEMMS: dict[str, str | bool | int] = {"xla_gpu_enable_triton_gemm": False}


@dataclasses.dataclass
class CompilationConfig:
    """Bucket ladders and ahead-of-time compilation.

    ``token_buckets`` pads the token axis of the model step, ``request_buckets``
    the request axis of logits and sampling; ``None`` picks a default ladder,
    dense at small sizes. ``cache_dir`` turns JAX's persistent compilation cache
    on, there, for the whole process (JAX has one cache per process: the user's
    own jitted functions are written there too); ``""``, the default unless
    ``JAXRUNNER_COMPILATION_CACHE_DIR`` names one, leaves JAX's cache settings
    as they are. ``compiler_options`` are XLA's options for every step
    program (``jax.stages.Lowered.compile``); ``None`` lets the program's row
    count choose (cuBLAS for the matmuls from ``CUBLAS_MIN_ROWS`` rows), ``{}``
    takes XLA's own defaults everywhere.
    """

    token_buckets: list[int] | None = None
    request_buckets: list[int] | None = None
    # A vision-language model's image encoder: patch counts it compiles for (None: two a octave from 64 up
    # to the largest image; each a multiple of the patches merged into one token).
    patch_buckets: list[int] | None = None
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)
    compiler_options: dict[str, str | bool | int] | None = None
    # Programs XLA compiles at once while precompiling: compilation releases the GIL, so more threads overlap
    # it; on a GPU, XLA's GEMM autotuning then times its candidates side by side too (1: one at a time).
    compile_threads: int = 1

    def step_compiler_options(self, num_rows: int, fp8_weight_only: bool = False) -> dict[str, str | bool | int]:
        """The options a step program over ``num_rows`` rows (tokens, or requests to sample) is compiled with.

        ``fp8_weight_only``: the program multiplies FP8 weights by unconverted inputs
        (``ops/fp8_matmul.py``'s ``"weight_only"``). It keeps XLA's own GEMMs at any
        row count: cuBLAS has no FP8 x bf16 product, so XLA would widen each whole
        weight to bf16 in a kernel of its own before the cuBLAS call, 3-5x the
        matmul (``benchmarks/decisions/fp8_weights.md``).
        """
        if self.compiler_options is not None:
            return dict(self.compiler_options)
        return dict(CUBLAS_GEMMS) if num_rows >= CUBLAS_MIN_ROWS and not fp8_weight_only else {}

    def __post_init__(self) -> None:
        if self.compile_threads < 1:
            raise ValueError(f"CompilationConfig.compile_threads must be at least 1; got {self.compile_threads}.")
        for name in ("token_buckets", "request_buckets", "patch_buckets"):
            ladder = getattr(self, name)
            if ladder is not None and (not ladder or any(b < 1 for b in ladder)):
                raise ValueError(f"CompilationConfig.{name} must be a non-empty list of positive sizes; got {ladder}.")


@dataclasses.dataclass
class MultiModalConfig:
    """Multimodal inputs (vLLM's ``MultiModalConfig``): ``limit_per_prompt`` caps the items of each modality
    one prompt may carry (``{"image": 4}``); a modality it does not name takes 999, as vLLM's V1.
    ``mm_processor_kwargs`` override the checkpoint's image processor settings (``{"max_pixels": ...}``).
    ``max_tokens_per_image`` is the most placeholder tokens the processor makes of one image (set from it
    when the engine starts; it tops the encoder's patch buckets)."""

    limit_per_prompt: dict[str, int] = dataclasses.field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_tokens_per_image: int | None = None

    DEFAULT_LIMIT = 999

    def __post_init__(self) -> None:
        for modality, limit in self.limit_per_prompt.items():
            if modality not in ("image", "video"):
                raise ValueError(f"limit_mm_per_prompt names {modality!r}; its modalities are 'image' and 'video'.")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a count (0 or more); got {limit!r}.")

    def limit(self, modality: str) -> int:
        """The most items of ``modality`` one prompt may carry."""
        return self.limit_per_prompt.get(modality, self.DEFAULT_LIMIT)


KV_CONNECTORS = ("OffloadingConnector", "SharedStorageConnector", "NoOpConnector")
"""The KV connectors ``KVTransferConfig.kv_connector`` may name: vLLM's two, and one whose hooks run and move
nothing (what the connector's calls cost)."""


@dataclasses.dataclass
class KVTransferConfig:
    """A KV connector (vLLM's ``KVTransferConfig``): which (one of :data:`KV_CONNECTORS`), its role
    ("kv_both", "kv_producer" saves only, "kv_consumer" loads only) and its settings:
    ``{"num_cpu_blocks": n}`` for the offloading connector's host pool, ``{"shared_storage_path": dir}``
    for the shared-storage connector's directory."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"KVTransferConfig.kv_connector {self.kv_connector!r} is not one of {', '.join(KV_CONNECTORS)}."
            )
        if self.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(
                f"KVTransferConfig.kv_role must be 'kv_both', 'kv_producer' or 'kv_consumer'; got {self.kv_role!r}."
            )


@dataclasses.dataclass
class RunnerConfig:
    """Everything the model runner needs, as vLLM's ``VllmConfig`` bundles it."""

    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    sampler_config: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None
    """None: LoRA off, and a request with a ``lora_request`` is refused."""
    multimodal_config: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)
    kv_transfer_config: KVTransferConfig | None = None
    """None: no KV connector (the no-op one)."""

    def __post_init__(self) -> None:
        steps = self.scheduler_config.num_scheduler_steps
        if self.speculative_config is not None and steps > 1:
            raise ValueError(
                "SchedulerConfig.num_scheduler_steps > 1 runs several plain decode steps per round and cannot "
                "verify drafts; use speculative decoding or multi-step scheduling, not both."
            )
        if steps > self.cache_config.block_size:
            raise ValueError(
                f"SchedulerConfig.num_scheduler_steps ({steps}) exceeds CacheConfig.block_size "
                f"({self.cache_config.block_size}): a round may take at most one new KV block per request. "
                "Lower num_scheduler_steps."
            )

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts verified per request and step; 0 without speculative decoding."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model on the device proposes the drafts (a draft model or an EAGLE head)."""
        return self.speculative_config is not None and self.speculative_config.method in ("draft_model", "eagle")
