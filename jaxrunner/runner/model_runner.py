"""The model runner: vLLM's ``GPUModelRunner`` contract over jitted, bucketed steps.

How this file is kept (vLLM's rule for its GPU runner): the runner is the
script of one step and stays small. ``execute_model`` and ``sample_tokens``
read as a short list of named phases; what is compiled and how belongs to
``compilation.py``, and each feature (prompt logprobs, structured output,
rounds of several decode steps, on-device drafters, LoRA adapters, and next
multimodal inputs, KV connectors) lives in its own module with its own
per-request state, costing the runner a line or two.

Each step runs at most three programs, each compiled ahead of time per bucket:
``write_new_requests`` (request bucket; only when requests join), the forward
step (token bucket: the step's inputs, the model, the gather of the rows to
sample) and the sampling step (request bucket: logits, sampling, post-update).
Splitting by axis keeps the number of programs the sum of the ladders, not
their product. The KV cache and the device state are donated to each program.
A round of several decode steps (``SchedulerConfig.num_scheduler_steps``) runs
as one program of its own, keyed by both buckets and the step count. With
LoRA, the forward programs take the adapter slots' weights as an argument, and
a request whose adapter no slot holds first loads it (``jaxrunner.runner.lora``).

The runner serves one mesh of ``tensor_parallel_size`` devices (one
data-parallel replica): every program is lowered with explicit shardings, the
parameters' from ``jaxrunner.sharding``, the KV caches split on their KV heads,
and the device state, step inputs and outputs replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrunner import envs
from jaxrunner.config import CACHE_DTYPES, LoRAConfig, ParallelConfig, RunnerConfig
from jaxrunner.interfaces import (
    AsyncModelRunnerOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models import CausalLM, TransformerConfig
from jaxrunner.models.builtin import is_builtin, load_named_model
from jaxrunner.models.converted import save_converted
from jaxrunner.models.eagle import EagleHead
from jaxrunner.models.kv_cache_groups import KVCacheGroups
from jaxrunner.models.loader import load_eagle_head
from jaxrunner.models.lora import LoRAWeights, add_lora_columns, lora_kernel_leaves
from jaxrunner.models.partitioning import param_shardings
from jaxrunner.models.transformer import PENDING_KV_SCALE, KVScale
from jaxrunner.ops import AttentionBackend
from jaxrunner.runner.async_output import AsyncOutput
from jaxrunner.runner.block_table import BlockTables
from jaxrunner.runner.compilation import (
    ActivationPeak,
    CompilationManager,
    ProgramInputs,
    abstract,
    enable_compilation_cache,
)
from jaxrunner.runner.decode_rounds import check_decode_round, check_num_decode_steps, check_round_output
from jaxrunner.runner.encoder_runner import EncoderRunner, check_multimodal_support
from jaxrunner.runner.input_batch import InputBatch, SampleRows, pack_step_buffer
from jaxrunner.runner.kv_cache import (
    KVCaches,
    KVCacheSpec,
    MemoryBudget,
    allocate_kv_caches,
    check_kv_cache_groups_support,
    size_kv_cache,
)
from jaxrunner.runner.kv_connector.factory import make_kv_connector
from jaxrunner.runner.kv_connector.mover import CompiledBlockMover
from jaxrunner.runner.lora import LORA_OFF, LoRASlots, check_lora_model_support, check_lora_support
from jaxrunner.runner.prompt_logprobs import PromptLogprobs
from jaxrunner.runner.spec_decode.draft_model import DraftModel
from jaxrunner.runner.spec_decode.drafter import Drafter
from jaxrunner.runner.spec_decode.eagle import EagleDrafter
from jaxrunner.runner.spec_decode.ngram import NO_DRAFT, NgramDrafter
from jaxrunner.runner.states import NO_LORA, DeviceState, RequestFeatureState, RequestState
from jaxrunner.runner.step_functions import StepStatics
from jaxrunner.runner.structured_outputs import GrammarBitmask, uses_grammar
from jaxrunner.runner.unsupported import refuse_unsupported
from jaxrunner.sample.logprobs import LogprobsTensors
from jaxrunner.sample.sampling_state import check_logprobs_count, pack_sampling_params, uses_sampling_stages
from jaxrunner.sharding import (
    host_copy,
    kv_cache_sharding,
    make_mesh,
    min_over_processes,
    replicated,
    tensor_parallel_size,
)
from jaxrunner.spans import Spans

logger = logging.getLogger(__name__)

# The modules a runner checks against its mesh: the model, a draft model, an EAGLE head.
_OnMesh = TypeVar("_OnMesh", CausalLM, EagleHead)


class _Dispatched(NamedTuple):
    """A step ``execute_model`` dispatched, for ``sample_tokens`` to finish: the forward's outputs,
    or the tokens of a round of several decode steps, whose one program sampled them already."""

    batch: InputBatch
    sample_hidden: jax.Array | None = None
    rows: SampleRows | None = None
    hidden: jax.Array | None = None
    tokens: jax.Array | None = None


class ModelRunner:
    """Holds the model, the KV cache and the request state; runs one step at a time.

    ``mesh`` is the replica's ``(data, model)`` mesh of one row (``jaxrunner.sharding``);
    by default the first ``tensor_parallel_size`` devices.
    """

    def __init__(self, config: RunnerConfig, mesh: Mesh | None = None, replica: int = 0):
        """``mesh`` is one replica's ``(1, tensor_parallel_size)`` mesh (default: the first
        devices); ``replica`` its data-parallel index: requests without a seed draw their
        seeds from (``ModelConfig.seed``, ``replica``), so replicas do not sample alike."""
        check_lora_support(config)
        self.config = config
        self.replica = replica
        tp = config.parallel_config.tensor_parallel_size
        self.mesh = mesh or make_mesh(ParallelConfig(tensor_parallel_size=tp))
        if tensor_parallel_size(self.mesh) != tp:
            raise ValueError(
                f"The mesh's model axis has {tensor_parallel_size(self.mesh)} devices but "
                f"ParallelConfig.tensor_parallel_size is {tp}; give the runner one replica's mesh."
            )
        self.replicated = replicated(self.mesh)
        self.kv_cache_sharding = kv_cache_sharding(self.mesh)
        self.attention_backend = AttentionBackend.for_devices(list(self.mesh.devices.flat))
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.block_size = config.cache_config.block_size
        self.num_spec = config.num_speculative_tokens
        spec = config.speculative_config
        if config.scheduler_config.async_scheduling and spec is not None and spec.method == "ngram":
            logger.warning(
                "Async scheduling is not supported with n-gram drafts proposed on the host and is off; "
                "method 'ngram_gpu' proposes the same drafts on the device, under async scheduling."
            )
        enable_compilation_cache(config.compilation_config.cache_dir)
        # Host time by phase (start-up and per step); benchmarks and the engine read it.
        self.spans = Spans()
        self.model: CausalLM | None = None
        self.kv_caches: KVCaches | None = None
        self.memory_budget: MemoryBudget | None = None  # how initialize_kv_cache shared out the device
        self.execute_model_state: _Dispatched | None = None

    @property
    def program_call_s(self) -> float:
        """Seconds spent inside calls of the compiled programs: XLA launches their kernels on the calling thread."""
        return self.spans.seconds.get("program_call", 0.0)

    @property
    def device_wait_s(self) -> float:
        """Seconds the host has spent blocked until sampled tokens arrived."""
        return self.spans.seconds.get("device_wait", 0.0)

    # ------------------------------------------------------------------ set-up

    def load_model(self, model: CausalLM | None = None, draft_model: CausalLM | None = None) -> None:
        """Load the model ``ModelConfig.model`` names (a checkpoint directory or a built-in), or take a built one.

        With a draft-model speculative config, ``draft_model`` (or the one the
        config names) proposes the drafts. Under tensor parallelism a given model
        must have been built for this runner's mesh (``mesh=runner.mesh``).
        ``CacheConfig.calculate_kv_scales`` is set on the models' attention layers.
        """
        with self.spans("load_model"):
            if model is None:
                if self.model_config.model is None:
                    raise ValueError("ModelConfig.model names no checkpoint directory, and no model was given.")
                model = self._load_named(self.model_config.model)
            check_multimodal_support(self.config, model.config)
            check_lora_model_support(self.config, model.config)
            self.model = model
            self.model_arch: TransformerConfig = model.config
            self.vocab_size = self.model_arch.vocab_size
            self.max_model_len = self._max_model_len(self.model_arch.max_position_embeddings)
            self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
            lora_config = self.config.lora_config
            lora_weights = None if lora_config is None else self._empty_lora_slots(lora_config, model)
            if lora_weights is not None:
                add_lora_columns(model, lora_weights)
            graphdef, params = nnx.split(self._with_kv_scale_mode(self._built_for_mesh(model)))
            self._param_leaves, params_treedef = jax.tree.flatten(self._place(params))
            self._params_treedef = params_treedef
            kv_dtype = jnp.dtype(CACHE_DTYPES[self.cache_config.cache_dtype] or model.dtype)
            self.attention_backend.check_kv_cache_dtype(
                kv_dtype, model.dtype, self.model_arch.head_dim, self.block_size
            )
            arch = self.model_arch
            windows = [arch.layer_sliding_window(i) for i in range(arch.num_layers)]
            self.kv_cache_groups = (
                KVCacheGroups.one_group(arch.num_layers)
                if self.config.scheduler_config.disable_hybrid_kv_cache_manager
                else KVCacheGroups.for_layers(windows, self.max_model_len)
            )
            check_kv_cache_groups_support(self.config, self.kv_cache_groups)
            self.kv_cache_spec = KVCacheSpec(
                num_layers=self.kv_cache_groups.num_tensors,
                block_size=self.block_size,
                num_kv_heads=self.model_arch.num_kv_heads,
                head_dim=self.model_arch.head_dim,
                dtype=kv_dtype,
            )
            vision = self.model_arch.vision
            self.uses_mrope = self.model_arch.mrope_section is not None
            self.req_states = RequestState(
                self.max_num_reqs,
                self.max_model_len,
                self.max_blocks_per_req,
                self.model_config.seed + (self.replica << 32),
                self.config.sampler_config,
                self.vocab_size,
                mrope_merge_size=vision.spatial_merge_size if vision is not None and self.uses_mrope else None,
                num_kv_cache_groups=self.kv_cache_groups.num_groups,
            )
            self.encoder_runner = None
            self.max_image_embeds: int | None = None  # the most tokens one image may take (None: no images)
            if vision is not None:
                compute_budget, cache_size = self.config.scheduler_config.encoder_budget(self.max_model_len)
                per_image = self.config.multimodal_config.max_tokens_per_image or self.max_model_len
                self.max_image_embeds = min(compute_budget, cache_size, self.max_model_len, per_image)
                self.encoder_runner = EncoderRunner(
                    cache_size, self.model_arch.hidden_size, model.dtype, vision, self.replicated
                )
            self.block_tables = BlockTables(
                self.max_num_reqs, self.max_blocks_per_req, self.block_size, self.kv_cache_groups.num_groups
            )
            self.drafter = self._load_drafter(draft_model, kv_dtype)
            self.device_state = self.fresh_device_state()
            draft_params = None if self.drafter is None else self._place(self.drafter.params)
            self._draft_leaves, draft_params_treedef = jax.tree.flatten(draft_params)
            self.draft_kv_caches: KVCaches = []
            self.lora = (
                None
                if lora_config is None or lora_weights is None
                else LoRASlots(
                    lora_weights,
                    lora_config,
                    self.model_arch,
                    self._param_leaves,
                    lora_kernel_leaves(self.params),
                    lambda: self.compilation.set_lora_slot.get(None),
                    self.spans,
                )
            )
            self.statics = StepStatics(
                graphdef=graphdef,
                params_treedef=params_treedef,
                draft_params_treedef=draft_params_treedef,
                drafter=self.drafter,
                attention_backend=self.attention_backend,
                block_size=self.block_size,
                max_num_reqs=self.max_num_reqs,
                num_spec=self.num_spec,
                sampler_config=self.config.sampler_config,
                ngram=self._device_ngram(),
                kv_cache_groups=self.kv_cache_groups if self.kv_cache_groups.num_groups > 1 else None,
            )
            self.compilation = CompilationManager(
                self.config.compilation_config,
                self.statics,
                self._program_inputs(model),
                max_num_tokens=self.max_num_tokens,
                decode_step_counts=self.config.scheduler_config.decode_step_counts,
                fp8=self.model_arch.quantization,
            )
            self.grammar_bitmask = GrammarBitmask(self.request_buckets, self.vocab_size, self.num_spec, self.replicated)
            self.prompt_logprobs = PromptLogprobs(self.compilation.prompt_logprobs, self.spans)
            # Per-request state of the features, beside the slots and block tables.
            self.request_features: list[RequestFeatureState] = [self.prompt_logprobs]
            self.request_features += [] if self.lora is None else [self.lora]
            self.request_features += [] if self.encoder_runner is None else [self.encoder_runner]
            # The KV connector's worker side (the no-op one without a KVTransferConfig: never called then).
            self.kv_connector = make_kv_connector(self.config, multimodal=vision is not None)
            self.uses_kv_connector = self.config.kv_transfer_config is not None
        logger.info("Model loaded in %.1f s", self.spans.seconds["load_model"])

    def fresh_device_state(self) -> DeviceState:
        """The device state with every slot unused and the KV cache scales as loaded (or pending)."""
        zeros = functools.partial(
            DeviceState.zeros,
            self.max_num_reqs,
            self.max_model_len,
            self.max_blocks_per_req * self.kv_cache_groups.num_groups,
            self.config.sampler_config,
            self.vocab_size,
            self.num_spec,
            mrope=self.uses_mrope,
        )
        return dataclasses.replace(
            jax.jit(zeros, out_shardings=self.replicated)(),  # made in place on the mesh
            kv_scales=self._initial_kv_scales(self.params),
            draft_kv_scales=self._initial_kv_scales(None if self.drafter is None else self.drafter.params),
        )

    def _load_drafter(self, draft_model: CausalLM | None, kv_dtype) -> Drafter | None:
        """The on-device proposer the speculative config names, if any; its KV cache is the target's dtype."""
        method = None if self.config.speculative_config is None else self.config.speculative_config.method
        if method == "draft_model":
            draft_model = self._with_kv_scale_mode(draft_model or self._load_named(self._draft_model_name()))
            return DraftModel.from_model(self._built_for_mesh(draft_model), self.block_size, kv_dtype, self.vocab_size)
        if method == "eagle":
            head = draft_model or load_eagle_head(
                self._draft_model_name(), dtype=self.model_config.dtype, mesh=self.mesh
            )
            if not isinstance(head, EagleHead):
                raise TypeError(f"EAGLE speculative decoding drafts with an EagleHead, not a {type(head).__name__}.")
            return EagleDrafter.from_head(
                self._built_for_mesh(self._with_kv_scale_mode(head)),
                self.block_size,
                kv_dtype,
                self.model_arch.hidden_size,
            )
        return None

    def _device_ngram(self) -> NgramDrafter | None:
        """The n-gram proposer on the device, for method "ngram_gpu"."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "ngram_gpu":
            return None
        return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _with_kv_scale_mode(self, module: _OnMesh) -> _OnMesh:
        """``module``, its attention layers computing pending KV cache scales if ``calculate_kv_scales``."""
        module.set_attributes(calculate_kv_scales=self.cache_config.calculate_kv_scales)
        return module

    @property
    def params(self) -> nnx.State:
        """The model's parameters as the forward programs take them (with LoRA, its kernels carry the
        slots' A)."""
        return jax.tree.unflatten(self._params_treedef, self._param_leaves)

    def _empty_lora_slots(self, lora_config: LoRAConfig, model: CausalLM) -> LoRAWeights:
        """Empty LoRA slots' B for ``model``, on every device."""
        arch = model.config
        empty = lambda: LoRAWeights.zeros(
            arch.num_layers, arch.projection_shapes(), lora_config.max_loras, lora_config.max_lora_rank, model.dtype
        )
        return jax.jit(empty, out_shardings=self.replicated)()  # made in place

    def _initial_kv_scales(self, params: nnx.State | None) -> nnx.State:
        """The device state's KV cache scales of a module's ``params`` (None: no module): copies of the
        loaded ones (the state is donated), or pending ones (set by the first write) with ``calculate_kv_scales``."""
        scales = nnx.State({}) if params is None else nnx.filter_state(params, KVScale)
        pending = self.cache_config.calculate_kv_scales
        scales = jax.tree.map(lambda s: jnp.full_like(s, PENDING_KV_SCALE) if pending else jnp.copy(s), scales)
        return jax.device_put(scales, self.replicated)

    def _program_inputs(self, model: CausalLM) -> ProgramInputs:
        encoder = self.encoder_runner
        vision = self.model_arch.vision
        return ProgramInputs(
            params=abstract(self._param_leaves),
            draft_params=abstract(self._draft_leaves),
            device_state=abstract(self.device_state),
            kv_cache=self.kv_cache_spec,
            draft_kv_cache=None if self.drafter is None else self.drafter.kv_spec,
            hidden=jax.ShapeDtypeStruct((self.model_arch.hidden_size,), model.dtype),
            new_request_layout=self.req_states.layout,
            vocab_size=self.vocab_size,
            cache_sharding=self.kv_cache_sharding,
            replicated=self.replicated,
            lora_weights=abstract(self.lora_weights),
            lora_kernels=None if self.lora is None else abstract(self.lora.kernels),
            encoder_cache=None if encoder is None else abstract(encoder.cache),
            patch_features=0 if vision is None else vision.patch_features,
            max_image_patches=encoder.merge_area * self.max_image_embeds if encoder and self.max_image_embeds else 0,
            merge_area=1 if encoder is None else encoder.merge_area,
            max_moved_blocks=(
                self.max_num_tokens // self.block_size + self.max_num_reqs if self.config.kv_transfer_config else 0
            ),
        )

    def _built_for_mesh(self, module: _OnMesh) -> _OnMesh:
        """``module``, checked to shard its attention over this runner's mesh (any mesh does for one device)."""
        if tensor_parallel_size(self.mesh) > 1 and module.mesh != self.mesh:
            raise ValueError(
                f"The model was built for mesh {module.mesh}, not this runner's {self.mesh}; under tensor "
                "parallelism build it with mesh=runner.mesh (load_model, init_random_model, load_builtin)."
            )
        return module

    def _place(self, params: nnx.State) -> nnx.State:
        """``params`` in their shardings on this runner's mesh (already there: nothing moves)."""
        return jax.device_put(params, param_shardings(self.mesh, params))

    def _draft_model_name(self) -> str:
        spec = self.config.speculative_config
        if spec is None or spec.model is None:
            method = None if spec is None else spec.method
            raise ValueError(f"SpeculativeConfig.model must name the draft model for method {method!r}.")
        return spec.model

    def _max_model_len(self, max_positions: int) -> int:
        """``ModelConfig.max_model_len``, or the model's positions; beyond them only when the user allows it
        (``$JAXRUNNER_ALLOW_LONG_MAX_MODEL_LEN=1``, as vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""
        max_model_len = self.model_config.max_model_len or max_positions
        if max_model_len > max_positions and not envs.JAXRUNNER_ALLOW_LONG_MAX_MODEL_LEN:
            raise ValueError(
                f"max_model_len {max_model_len} is more than the model's {max_positions} positions "
                f"(max_position_embeddings): lower max_model_len, or set {envs.ALLOW_LONG_MAX_MODEL_LEN_ENV_VAR}=1 "
                "to allow it (outputs past the model's positions may be wrong)."
            )
        return max_model_len

    def save_converted(self, out_dir: str) -> None:
        """Write the model as this runner holds it (``models/converted.py``), for ``LLM(model=out_dir)`` to restore
        without re-reading the checkpoint; the model must have come from a checkpoint directory."""
        name = self.model_config.model
        if name is None or is_builtin(name) or self.model is None:
            raise ValueError(f"model {name!r} is no checkpoint directory: only a loaded checkpoint can be converted")
        if self.lora is not None:
            raise ValueError(
                "save_converted with LoRA on would write the LoRA slots' columns into the projections: "
                "convert the model with enable_lora=False (the converted model serves adapters as well)."
            )
        save_converted(self.params, self.model, name, out_dir)

    def _load_named(self, name: str) -> CausalLM:
        """A checkpoint directory's model, or a built-in's with random weights from the engine's seed."""
        return load_named_model(
            name,
            dtype=self.model_config.dtype,
            seed=self.model_config.seed,
            mesh=self.mesh,
            max_model_len=self.model_config.max_model_len,
            quantization=self.model_config.quantization,
        )

    def profile_run(self) -> ActivationPeak:
        """The activation peak of the largest steps, run once on dummy inputs (``CompilationManager.profile_run``)."""
        with self.spans("profile_run"):
            return self.compilation.profile_run(self._param_leaves, self._draft_leaves, self.mesh.local_devices[0])

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the KV cache, sized by vLLM's rule after a profile run unless given; ``memory_budget`` says how."""
        with self.spans("initialize_kv_cache"):
            if num_blocks is None and self.cache_config.num_gpu_blocks_override is not None:
                num_blocks = self.cache_config.num_gpu_blocks_override
            tp = tensor_parallel_size(self.mesh)  # each device holds its share of every block, a drafter's too
            bytes_per_block = sum(spec.per_device(tp).bytes_per_block for spec in self._kv_specs())
            groups = self.kv_cache_groups.num_groups
            if num_blocks is None:
                budget = size_kv_cache(
                    self.block_size,
                    bytes_per_block,
                    self.cache_config,
                    self.mesh.local_devices[0],
                    activation_bytes=self.profile_run().bytes,
                    max_useful_blocks=self.max_num_reqs * self.max_blocks_per_req * groups + 1,
                )
                num_blocks = min_over_processes(budget.num_blocks)  # every host holds the same blocks
                self.memory_budget = dataclasses.replace(budget, num_blocks=num_blocks, num_kv_cache_groups=groups)
            else:
                utilization = self.cache_config.gpu_memory_utilization
                self.memory_budget = MemoryBudget(
                    num_blocks, self.block_size, bytes_per_block, utilization, num_kv_cache_groups=groups
                )
            self.num_blocks = self.compilation.num_blocks = num_blocks
            self.block_mover = CompiledBlockMover(self.compilation, num_blocks, self.kv_cache_sharding)
            self.kv_caches = allocate_kv_caches(self.kv_cache_spec, num_blocks, self.kv_cache_sharding)
            if self.drafter is not None:
                self.draft_kv_caches = allocate_kv_caches(self.drafter.kv_spec, num_blocks, self.kv_cache_sharding)
            logger.info("Memory: %s", self.memory_budget)
            return num_blocks

    def _kv_specs(self) -> list[KVCacheSpec]:
        """The caches on the block ids the scheduler hands out: the model's, and a drafter's."""
        return [self.kv_cache_spec] + ([] if self.drafter is None else [self.drafter.kv_spec])

    def capture_model(self) -> float:
        """Precompile every program of every bucket (the counterpart of CUDA graph capture); returns seconds."""
        with self.spans("capture_model"):
            return self.compilation.capture_model()

    @property
    def token_buckets(self) -> list[int]:
        return self.compilation.token_buckets

    @property
    def request_buckets(self) -> list[int]:
        return self.compilation.request_buckets

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled so far over all buckets (flat after ``capture_model``)."""
        return self.compilation.num_compiled_programs

    def program_memory_bytes(self) -> dict[str, dict[str, dict[str, int]]]:
        """XLA's memory analysis of every compiled program, by kind and bucket (for benchmarks)."""
        return self.compilation.program_memory_bytes()

    # ------------------------------------------------------------------- steps

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Update request state and dispatch the forward step; ``sample_tokens`` finishes it."""
        with self.spans("execute_model"):
            if self.kv_caches is None:
                raise RuntimeError("initialize_kv_cache() must run before execute_model().")
            refuse_unsupported(
                scheduler_output,
                lora_enabled=self.lora is not None,
                multimodal=self.encoder_runner is not None,
                num_kv_cache_groups=self.kv_cache_groups.num_groups,
            )
            self.finish_requests(scheduler_output)
            self.add_requests(scheduler_output)
            self.update_requests(scheduler_output)
            connector_metadata = scheduler_output.kv_connector_metadata
            if self.uses_kv_connector:  # the runner we mirror's pre_forward
                with self.spans("kv_load"):
                    self.kv_caches = self.kv_connector.start_load_kv(
                        connector_metadata, self.kv_caches, self.block_mover
                    )
            if scheduler_output.total_num_scheduled_tokens == 0:
                return ModelRunnerOutput.make_empty()
            self.execute_mm_encoder(scheduler_output)
            batch, step_buffer = self.prepare_inputs(scheduler_output)
            if batch.num_steps > 1:
                self.execute_model_state = self.run_decode_round(batch, step_buffer)
            else:
                self.execute_model_state = self.run_forward(batch, step_buffer)
            if self.uses_kv_connector:  # post_forward
                with self.spans("kv_save"):
                    self.kv_connector.save_kv(connector_metadata, self.kv_caches, self.block_mover)
            return None

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the step dispatched by ``execute_model``.

        Returns its ``ModelRunnerOutput``, or with async scheduling an
        ``AsyncModelRunnerOutput`` whose device-to-host copy is under way: the
        next step can be dispatched before ``get_output()`` waits for it.
        """
        with self.spans("sample_tokens"):
            if self.execute_model_state is None:
                raise RuntimeError("sample_tokens() called without a preceding execute_model().")
            dispatched, self.execute_model_state = self.execute_model_state, None
            if dispatched.tokens is not None:  # a round of decode steps, sampled in its own program
                output = self.output(AsyncOutput(dispatched.batch, dispatched.tokens, None, {}, self.spans))
                check_round_output(grammar_output)
                return output
            tokens, logprobs = self.sample(dispatched, grammar_output)
            assert dispatched.hidden is not None  # a forward's dispatch (no tokens yet) carries its hidden states
            prompt_logprobs = self.prompt_logprobs.compute(
                dispatched.batch, dispatched.hidden, self.req_states.num_computed_tokens, self._param_leaves
            )
            return self.output(AsyncOutput(dispatched.batch, tokens, logprobs, prompt_logprobs, self.spans))

    @property
    def use_async_scheduling(self) -> bool:
        """Whether ``sample_tokens`` returns before the tokens reach the host.

        Under speculative decoding only while the drafts are proposed on the device
        (a draft model, an EAGLE head, "ngram_gpu"): the next step reads them there,
        with the accepted counts and last accepted tokens, before the host has seen
        them. Drafts proposed on the host ("ngram") need the last tokens first.
        """
        async_scheduling = self.config.scheduler_config.async_scheduling
        return async_scheduling and (self.num_spec == 0 or self.statics.drafts_on_device)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts proposed on the device for each running request's next step, up to the first
        the proposer could not fill (vLLM's ``take_draft_token_ids``: the host needs them to build a
        grammar's bitmask rows); {} where the host proposes them. Waits for the last step."""
        if not self.statics.drafts_on_device:
            return {}
        drafts = host_copy(self.device_state.draft_tokens)
        filled = np.cumprod(drafts != NO_DRAFT, axis=1).sum(axis=1)
        return {
            req_id: drafts[slot, : filled[slot]].tolist() for req_id, slot in self.req_states.req_id_to_index.items()
        }

    # ------------------------------------------------------------ request state

    def finish_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Free the slots of the requests the scheduler finished or preempted, and the encoder outputs it dropped."""
        if self.encoder_runner is not None:
            for mm_hash in scheduler_output.free_encoder_mm_hashes:
                self.encoder_runner.free_encoder_cache(mm_hash)
        done = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        for req_id in done:
            slot = self.req_states.req_id_to_index.get(req_id)
            if slot is not None:
                self.block_tables.clear(slot)
                self.req_states.remove_request(req_id)
            for feature in self.request_features:
                feature.remove_request(req_id)

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Give new (and resumed) requests slots and block tables, and write their rows to the device."""
        for new_req in scheduler_output.scheduled_new_reqs:
            lora_slot = NO_LORA if self.lora is None else self.lora.slot_for(new_req)
            slot = self.req_states.add_request(new_req, lora_slot)
            self.block_tables.append_block_ids(slot, new_req.block_ids or ([],), overwrite=True)
            for feature in self.request_features:
                feature.add_request(new_req, slot)
        num_new = self.req_states.num_staged
        if num_new:
            bucket = self.compilation.request_bucket(num_new, "new requests")
            rows = self.req_states.take_staged_rows(bucket)
            self.device_state = self._call(self.compilation.write_new_requests.get(bucket), self.device_state, rows)

    def update_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Append the blocks the scheduler gave running requests this step."""
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_block_ids is None:
                continue
            slot = self.req_states.req_id_to_index.get(req_id)
            if slot is None:
                raise _not_on_runner(req_id)
            self.block_tables.append_block_ids(slot, new_block_ids, overwrite=False)

    # ------------------------------------------------------------ step phases

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> tuple[InputBatch, np.ndarray]:
        """Order the batch (decodes first), pick buckets and pack the step buffer (of one step of a round)."""
        with self.spans("prepare_inputs"):
            scheduled = scheduler_output.num_scheduled_tokens
            req_ids = sorted(scheduled, key=scheduled.__getitem__)
            num_scheduled = np.fromiter(map(scheduled.__getitem__, req_ids), np.int32, len(req_ids))
            slot_of = self.req_states.req_id_to_index
            slots = [slot_of.get(r) for r in req_ids]
            if None in slots:
                raise _not_on_runner(req_ids[slots.index(None)])
            idx_mapping = np.array(slots, np.int32)
            if int(num_scheduled.sum()) != scheduler_output.total_num_scheduled_tokens:
                raise ValueError(
                    f"total_num_scheduled_tokens ({scheduler_output.total_num_scheduled_tokens}) differs "
                    f"from the sum of num_scheduled_tokens ({int(num_scheduled.sum())})."
                )
            if (num_scheduled < 1).any():
                raise ValueError("Every request in num_scheduled_tokens must be scheduled at least one token.")
            computed = self.req_states.num_computed_tokens[idx_mapping]
            seq_lens = computed + num_scheduled
            steps = scheduler_output.num_decode_steps
            check_num_decode_steps(steps, self.config.scheduler_config.decode_step_counts)
            if steps > 1:
                check_decode_round(scheduler_output, req_ids, num_scheduled, computed, idx_mapping, self.req_states)
                num_scheduled = np.ones_like(num_scheduled)  # one token a step
            num_tokens = int(num_scheduled.sum())
            if (seq_lens > self.max_model_len).any():
                bad = req_ids[int(np.argmax(seq_lens > self.max_model_len))]
                raise ValueError(
                    f"Request {bad!r} would reach {int(seq_lens.max())} tokens, past max_model_len "
                    f"({self.max_model_len})."
                )
            token_bucket = self.compilation.token_bucket(num_tokens)
            request_bucket = self.compilation.request_bucket(len(req_ids))
            shape = self.compilation.step_shapes[token_bucket]
            appends = self.block_tables.take_staged(shape.append_capacity)
            drafts, num_drafts = self._drafts(req_ids, scheduler_output.scheduled_spec_decode_tokens)
            encoder_rows = None
            if self.encoder_runner is not None and steps == 1:
                encoder_rows = self.encoder_runner.gather_mm_embeddings(req_ids, num_scheduled, computed)
            step_buffer = pack_step_buffer(
                shape, idx_mapping, num_scheduled, drafts, appends, self.max_num_reqs, encoder_rows
            )
            batch = InputBatch(
                req_ids=req_ids,
                idx_mapping_np=idx_mapping,
                admissions_np=self.req_states.admissions[idx_mapping],
                num_scheduled_tokens=num_scheduled,
                num_tokens_after_padding=token_bucket,
                num_reqs_after_padding=request_bucket,
                is_sampling_np=seq_lens >= self.req_states.prefill_len[idx_mapping],
                num_drafts=num_drafts,
                num_steps=steps,
            )
            return batch, step_buffer

    def _drafts(self, req_ids: list[str], spec: dict[str, list[int]]) -> tuple[list[list[int]], np.ndarray]:
        """Each request's draft tokens to verify, and their counts; no lists (and zero counts) when
        no request has drafts, as in most steps."""
        if not spec:
            return [], np.zeros(len(req_ids), np.int32)
        drafts = [spec.get(r, []) for r in req_ids]
        num_drafts = np.array([len(d) for d in drafts], np.int32)
        if num_drafts.max() > self.num_spec:
            raise ValueError(f"A request carries more than num_speculative_tokens ({self.num_spec}) draft tokens.")
        return drafts, num_drafts

    def execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> None:
        """Encode the images the step schedules into the encoder cache (vision-language models)."""
        if self.encoder_runner is not None and scheduler_output.scheduled_encoder_inputs:
            with self.spans("encoder"):
                self.encoder_runner.execute_mm_encoder(
                    scheduler_output.scheduled_encoder_inputs,
                    self.compilation,
                    lambda program, *args: self._call(program, self._param_leaves, *args),
                )

    @property
    def encoder_cache(self) -> jax.Array | None:
        """The encoder outputs the forward programs read (None: a text model)."""
        return None if self.encoder_runner is None else self.encoder_runner.cache

    def run_forward(self, batch: InputBatch, step_buffer: np.ndarray) -> _Dispatched:
        """Dispatch the forward program of the batch's token bucket."""
        program = self.compilation.forward.get(batch.num_tokens_after_padding)
        self.kv_caches, self.draft_kv_caches, self.device_state, sample_hidden, rows, hidden = self._call(
            program,
            self._param_leaves,
            self._draft_leaves,
            self.kv_caches,
            self.draft_kv_caches,
            self.device_state,
            step_buffer,
            self.lora_weights,
            self.encoder_cache,
        )
        return _Dispatched(batch, sample_hidden, rows, hidden)

    def run_decode_round(self, batch: InputBatch, step_buffer: np.ndarray) -> _Dispatched:
        """Dispatch a round of several decode steps: forward and plain sampling, in one program."""
        key = (batch.num_tokens_after_padding, batch.num_reqs_after_padding, batch.num_steps)
        self.kv_caches, self.draft_kv_caches, self.device_state, tokens = self._call(
            self.compilation.decode_steps.get(key),
            self._param_leaves,
            self._draft_leaves,
            self.kv_caches,
            self.draft_kv_caches,
            self.device_state,
            step_buffer,
            self.lora_weights,
            self.encoder_cache,
        )
        return _Dispatched(batch, tokens=tokens)

    def sample(
        self, dispatched: _Dispatched, grammar_output: GrammarOutput | None
    ) -> tuple[jax.Array, LogprobsTensors | None]:
        """Dispatch the sampling program of the batch's request bucket: its tokens, and logprobs if asked for.

        A batch whose requests all sample from temperature alone, with no logprobs
        and no grammar, runs the plain sampling program, which has no conditionals.
        """
        batch = dispatched.batch
        bitmask, active = self.grammar_bitmask.rows(batch, grammar_output)
        wants_logprobs = bool(((self.req_states.num_logprobs[batch.idx_mapping_np] > 0) & batch.is_sampling_np).any())
        plain = (
            self.num_spec == 0
            and not wants_logprobs
            and not uses_grammar(grammar_output)
            and bool(self.req_states.plain_sampling[batch.idx_mapping_np].all())
        )
        program = self.compilation.sample.get((batch.num_reqs_after_padding, plain))
        self.draft_kv_caches, self.device_state, tokens, logprobs = self._call(
            program,
            self._param_leaves,
            self._draft_leaves,
            self.draft_kv_caches,
            dispatched.sample_hidden,
            dispatched.rows,
            self.device_state,
            bitmask,
            active,
        )
        return tokens, logprobs if wants_logprobs else None

    def output(self, output: AsyncOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's output: pending under async scheduling, else waited for.

        The host counts every scheduled token as computed at once, as the scheduler
        does; the rejected drafts are taken back when the tokens reach the host.
        """
        batch = output.batch
        self.req_states.num_computed_tokens[batch.idx_mapping_np] += batch.num_scheduled_tokens * batch.num_steps
        if batch.num_drafts.any():
            output.on_sampled = functools.partial(self._take_back_rejected, batch)
        return output if self.use_async_scheduling else output.get_output()

    def _take_back_rejected(self, batch: InputBatch, sampled: list[list[int]]) -> None:
        """Take the rejected drafts back from the host's num_computed_tokens: each request's drafts
        less those it emitted, in the slots the batch's requests still hold (under async scheduling
        a slot may have been freed, or taken again, before its step's tokens were read)."""
        rejected = np.array([d - (len(t) - 1) if t else 0 for d, t in zip(batch.num_drafts, sampled)], np.int32)
        held = self.req_states.admissions[batch.idx_mapping_np] == batch.admissions_np
        self.req_states.num_computed_tokens[batch.idx_mapping_np[held]] -= rejected[held]

    @property
    def lora_weights(self) -> LoRAWeights | None:
        """The LoRA slots' weights the forward programs take (None: LoRA off)."""
        return None if self.lora is None else self.lora.weights

    def _call(self, program: jax.stages.Compiled, *args):
        """Call a compiled program; XLA launches its kernels on this thread, so the call is a span of its own."""
        with self.spans("program_call"):
            return program(*args)

    # ------------------------------------------------------- request checks

    def samples_plainly(self, params: SamplingParams) -> bool:
        """Whether requests with these parameters take the plain sampling program (no stage before
        the draw, no logprobs), as a round of several decode steps needs."""
        fields = pack_sampling_params(params, random.Random(0), self.config.sampler_config, self.vocab_size)
        return fields["num_logprobs"] == 0 and not uses_sampling_stages(fields)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Raise ValueError if the runner cannot hold these parameters (capacities, token ids)."""
        pack_sampling_params(params, random.Random(0), self.config.sampler_config, self.vocab_size)
        check_logprobs_count("prompt_logprobs", params.prompt_logprobs, self.config.sampler_config)

    def check_lora_request(self, lora_request: LoRARequest) -> None:
        """Raise ValueError if the runner cannot run this adapter: LoRA off, or a bad adapter
        (``LoRAAdapterError`` naming it). A good one is read into the host's LRU, where its first request finds it."""
        if self.lora is None:
            raise ValueError(LORA_OFF)
        self.lora.adapters.get(lora_request)


def _not_on_runner(req_id: str) -> ValueError:
    return ValueError(f"Request {req_id!r} is scheduled but not on the runner; schedule it first as a new request.")
