"""The model runner: vLLM's ``GPUModelRunner`` contract over jitted, bucketed steps.

Each step runs at most three programs, each compiled ahead of time per bucket:
``write_new_requests`` (request bucket; only when requests join), the forward
step (token bucket: input preparation, the model, the gather of the rows to
sample) and the sampling step (request bucket: logits, sampling, post-update).
Splitting by axis keeps the number of programs the sum of the ladders, not
their product. The KV cache and the device state are donated to each program.
A round of several decode steps (``SchedulerConfig.num_scheduler_steps``) runs
as one program of its own, keyed by both buckets and the step count.

The runner serves one mesh of ``tensor_parallel_size`` devices (one
data-parallel replica): every program is lowered with explicit shardings, the
parameters' from ``jaxrunner.sharding``, the KV caches split on their KV heads,
and the device state, step inputs and outputs replicated.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxrunner import compat
from jaxrunner.runner.block_table import BlockTables
from jaxrunner.runner.buckets import CompiledPrograms, CompileCounter, make_ladder, pad_to_bucket
from jaxrunner.config import ParallelConfig, RunnerConfig
from jaxrunner.runner.input_batch import (
    InputBatch,
    SampleRows,
    StepShape,
    pack_step_buffer,
)
from jaxrunner.interfaces import (
    AsyncModelRunnerOutput,
    GrammarOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from jaxrunner.runner.kv_cache import (
    KVCacheSpec,
    KVCaches,
    allocate_kv_caches,
    determine_num_blocks,
    kv_cache_capacity,
)
from jaxrunner.models import CausalLM, TransformerConfig
from jaxrunner.models.loader import load_eagle_head
from jaxrunner.runner import step_functions
from jaxrunner.sample.logprobs import LogprobsTensors
from jaxrunner.runner.spec_decode.draft_model import DraftModel
from jaxrunner.runner.spec_decode.eagle import EagleDrafter
from jaxrunner.runner.step_functions import StepStatics
from jaxrunner.sample.sampling_state import (
    bitmask_words,
    check_logprobs_count,
    pack_sampling_params,
    uses_sampling_stages,
)
from jaxrunner.spans import Spans
from jaxrunner.sharding import host_copy, kv_cache_sharding, make_mesh, min_over_processes, replicated, tensor_parallel_size
from jaxrunner.models.partitioning import param_shardings
from jaxrunner.runner.states import DeviceState, RequestState, write_new_requests

logger = logging.getLogger(__name__)

# Blocks of the throw-away KV cache the profile run compiles against.
_PROFILE_NUM_BLOCKS = 16


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
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.block_size = config.cache_config.block_size
        self.num_spec = config.num_speculative_tokens
        self.token_buckets = make_ladder(
            config.compilation_config.token_buckets, self.max_num_tokens, "token_buckets"
        )
        self.request_buckets = make_ladder(
            config.compilation_config.request_buckets, self.max_num_reqs, "request_buckets"
        )
        # XLA's options for a step program, by its row count.
        self.compiler_options = config.compilation_config.step_compiler_options
        compat.enable_persistent_compilation_cache(config.compilation_config.cache_dir)
        CompileCounter.install()
        self.model: CausalLM | None = None
        self.kv_caches: KVCaches | None = None
        self.execute_model_state: _Dispatched | None = None
        # Requests that asked for prompt logprobs: their prompt and top count.
        self._prompt_logprob_requests: dict[str, tuple[np.ndarray, int]] = {}
        # Seconds the host has spent blocked until sampled tokens arrived.
        self.device_wait_s = 0.0
        # Seconds spent inside calls of the compiled programs: XLA launches their kernels on the calling thread.
        self.program_call_s = 0.0
        self.spans = Spans()

    # ------------------------------------------------------------------ set-up

    def load_model(self, model: CausalLM | None = None, draft_model: CausalLM | None = None) -> None:
        """Load the model ``ModelConfig.model`` names (a checkpoint directory or a built-in), or take a built one.

        With a draft-model speculative config, ``draft_model`` (or the one the
        config names) proposes the drafts. Under tensor parallelism a given model
        must have been built for this runner's mesh (``mesh=runner.mesh``).
        """
        start = time.perf_counter()
        if model is None:
            if self.model_config.model is None:
                raise ValueError("ModelConfig.model names no checkpoint directory, and no model was given.")
            model = self._load_named(self.model_config.model)
        self.model = model
        self.model_arch: TransformerConfig = model.config
        self.vocab_size = self.model_arch.vocab_size
        self.max_model_len = self.model_config.max_model_len or self.model_arch.max_position_embeddings
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self._graphdef, params = nnx.split(self._built_for_mesh(model))
        self.params = self._place(params)
        self._param_leaves, self._params_treedef = jax.tree.flatten(self.params)
        cache_dtype = self.cache_config.cache_dtype
        kv_dtype = model.dtype if cache_dtype == "auto" else jnp.dtype(cache_dtype)
        self.kv_cache_spec = KVCacheSpec(
            num_layers=self.model_arch.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.model_arch.num_kv_heads,
            head_dim=self.model_arch.head_dim,
            dtype=kv_dtype,
        )
        self.req_states = RequestState(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.model_config.seed + (self.replica << 32),
            self.config.sampler_config, self.vocab_size,
        )
        self.block_tables = BlockTables(self.max_num_reqs, self.max_blocks_per_req, self.block_size)
        zeros = functools.partial(
            DeviceState.zeros, self.max_num_reqs, self.max_model_len, self.max_blocks_per_req,
            self.config.sampler_config, self.vocab_size, self.num_spec,
        )
        self.device_state = jax.jit(zeros, out_shardings=self.replicated)()  # made in place on the mesh
        self.drafter = None
        method = None if self.config.speculative_config is None else self.config.speculative_config.method
        if method == "draft_model":
            draft_model = draft_model or self._load_named(self._draft_model_name())
            self.drafter = DraftModel.from_model(
                self._built_for_mesh(draft_model), self.block_size, kv_dtype, self.vocab_size
            )
        elif method == "eagle":
            head = draft_model or load_eagle_head(
                self._draft_model_name(), dtype=self.model_config.dtype, mesh=self.mesh
            )
            self.drafter = EagleDrafter.from_head(
                self._built_for_mesh(head), self.block_size, kv_dtype, self.model_arch.hidden_size
            )
        self.draft_params = None if self.drafter is None else self._place(self.drafter.params)
        self._draft_leaves, self._draft_params_treedef = jax.tree.flatten(self.draft_params)
        self.draft_kv_caches: KVCaches = []
        self._build_programs()
        logger.info("Model loaded in %.1f s", time.perf_counter() - start)

    def _built_for_mesh(self, module: nnx.Module) -> nnx.Module:
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
        if spec.model is None:
            raise ValueError(f"SpeculativeConfig.model must name the draft model for method {spec.method!r}.")
        return spec.model

    def _load_named(self, name: str) -> CausalLM:
        """A checkpoint directory's model, or a built-in's with random weights from the engine's seed."""
        from jaxrunner.models.builtin import load_named_model

        return load_named_model(name, dtype=self.model_config.dtype, seed=self.model_config.seed, mesh=self.mesh)

    def profile_run(self) -> int:
        """Activation bytes of the largest steps, from XLA's memory analysis of their programs."""
        tokens, reqs = self.token_buckets[-1], self.request_buckets[-1]
        forward = self._lower_forward(tokens, _PROFILE_NUM_BLOCKS)
        sample = self._sample_lower(reqs, _PROFILE_NUM_BLOCKS)
        forward = forward.compile(compiler_options=self.compiler_options(tokens))
        sample = sample.compile(compiler_options=self.compiler_options(reqs))
        total = 0
        for program in (forward, sample):
            analysis = program.memory_analysis()
            total += int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
        return total

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the KV cache, sized from free memory after a profile run unless given."""
        if num_blocks is None and self.cache_config.num_gpu_blocks_override is not None:
            num_blocks = self.cache_config.num_gpu_blocks_override
        if num_blocks is None:
            tp = tensor_parallel_size(self.mesh)
            draft = None if self.drafter is None else self.drafter.kv_spec.per_device(tp)
            num_blocks = determine_num_blocks(
                self.kv_cache_spec.per_device(tp),
                self.cache_config,
                self.mesh.local_devices[0],
                activation_bytes=self.profile_run(),
                max_useful_blocks=self.max_num_reqs * self.max_blocks_per_req + 1,
                extra_bytes_per_block=0 if draft is None else draft.bytes_per_block,
            )
            num_blocks = min_over_processes(num_blocks)  # every host holds the same blocks
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec, num_blocks, self.kv_cache_sharding)
        if self.drafter is not None:
            self.draft_kv_caches = allocate_kv_caches(self.drafter.kv_spec, num_blocks, self.kv_cache_sharding)
        logger.info("KV cache: %s", kv_cache_capacity(self.kv_cache_spec, num_blocks))
        return num_blocks

    def capture_model(self) -> float:
        """Precompile every bucket (the counterpart of CUDA graph capture); returns seconds."""
        start = time.perf_counter()
        jobs = [(self._forward_programs, b) for b in self.token_buckets]
        jobs += [(self._sample_programs, (b, plain)) for b in self.request_buckets for plain in self._sample_paths]
        jobs += [(self._write_programs, b) for b in self.request_buckets]
        jobs += [(self._decode_steps_programs, key) for key in self._decode_steps_keys()]
        for programs, bucket in tqdm(jobs, desc="Precompiling buckets", leave=False):
            programs.get(bucket)
        return time.perf_counter() - start

    def _decode_steps_keys(self) -> list[tuple[int, int, int]]:
        """(token bucket, request bucket, steps) of every round of several decode steps the scheduler can make."""
        counts = self.config.scheduler_config.decode_step_counts[1:]
        largest = min(self.max_num_reqs, self.token_buckets[-1])
        buckets = {
            (pad_to_bucket(n, self.token_buckets, "tokens"), pad_to_bucket(n, self.request_buckets, "requests"))
            for n in range(1, largest + 1)
        }
        return [(t, r, k) for t, r in sorted(buckets) for k in counts]

    @property
    def _sample_paths(self) -> tuple[bool, ...]:
        """The sampling programs' ``plain`` values: the plain path exists without drafts only."""
        return (False,) if self.num_spec else (False, True)

    @property
    def _step_programs(self) -> tuple[CompiledPrograms, ...]:
        return (self._forward_programs, self._sample_programs, self._write_programs, self._decode_steps_programs)

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled so far over all buckets (flat after ``capture_model``)."""
        return sum(p.num_compiled for p in self._step_programs)

    def program_memory_bytes(self) -> dict[str, dict[str, dict[str, int]]]:
        """XLA's memory analysis of every compiled step program, by kind and bucket (for benchmarks)."""
        return {p.name: p.memory_bytes() for p in self._step_programs}

    # ---------------------------------------------------------------- programs

    def _step_shape(self, num_tokens: int) -> StepShape:
        num_reqs = min(num_tokens, self.max_num_reqs)
        capacity = BlockTables.append_capacity(num_tokens, num_reqs, self.block_size)
        return StepShape(
            num_tokens=num_tokens, num_reqs=num_reqs, append_capacity=capacity, num_spec=self.num_spec,
            drafts_on_device=self.config.uses_draft_model,
        )

    def _abstract(self, tree: Any) -> Any:
        """Shape, dtype and sharding of every array in ``tree``."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

    def _input(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """A step input from the host: replicated over the mesh."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def _build_programs(self) -> None:
        statics = StepStatics(
            graphdef=self._graphdef, params_treedef=self._params_treedef,
            draft_params_treedef=self._draft_params_treedef, drafter=self.drafter, block_size=self.block_size,
            max_num_reqs=self.max_num_reqs, num_spec=self.num_spec, sampler_config=self.config.sampler_config,
        )
        self._statics = statics
        options, options_of_first = self.compiler_options, lambda key: self.compiler_options(key[0])
        self._forward_programs = CompiledPrograms(
            "forward", lambda b: self._lower_forward(b, self.num_blocks), options
        )
        self._decode_steps_programs = CompiledPrograms(
            "decode_steps", lambda key: self._lower_decode_steps(*key), options_of_first
        )
        # Outputs keep the inputs' layout: caches split on KV heads, everything else replicated.
        cache, whole = self.kv_cache_sharding, self.replicated
        sample_jit = jax.jit(
            functools.partial(step_functions.sample_step, statics), static_argnames=("num_rows", "plain"),
            donate_argnums=(2, 5), out_shardings=(cache, whole, whole, whole),
        )
        write_jit = jax.jit(
            functools.partial(write_new_requests, layout=self.req_states.layout), donate_argnums=(0,),
            out_shardings=whole,
        )
        prompt_logprobs_jit = jax.jit(functools.partial(step_functions.prompt_logprobs, statics), out_shardings=whole)
        words = bitmask_words(self.vocab_size)
        hidden_spec = self._input((self.max_num_reqs, self.num_spec + 1, self.model_arch.hidden_size), self.model.dtype)
        rows_spec = jax.tree.map(
            lambda a: self._input(a.shape, a.dtype), SampleRows.abstract(self.max_num_reqs, self.num_spec)
        )
        self._sample_lower = lambda b, num_blocks, plain=False: sample_jit.lower(
            self._abstract(self._param_leaves), self._abstract(self._draft_leaves),
            self._abstract_draft_kv(num_blocks), hidden_spec, rows_spec, self._abstract(self.device_state),
            self._input((b, words), jnp.int32), self._input((b,), jnp.bool_),
            num_rows=b, plain=plain,
        )
        # One program per (request bucket, plain path): see sample_tokens.
        self._sample_programs = CompiledPrograms(
            "sample", lambda key: self._sample_lower(key[0], self.num_blocks, key[1]), options_of_first
        )
        # Compiled on first use: only batches with prompt-logprob requests need them.
        self._prompt_logprob_programs = CompiledPrograms(
            "prompt_logprobs",
            lambda b: prompt_logprobs_jit.lower(
                self._abstract(self._param_leaves), self._input((b, self.model_arch.hidden_size), self.model.dtype),
                self._input((b,), jnp.int32), self._input((b,), jnp.int32),
            ),
            options,
        )
        self._no_grammar = {
            b: jax.device_put((np.zeros((b, words), np.int32), np.zeros(b, np.bool_)), whole)
            for b in self.request_buckets
        }
        self._write_programs = CompiledPrograms(
            "write_new_requests",
            lambda b: write_jit.lower(
                self._abstract(self.device_state), self._input((b, self.req_states.row_words), jnp.int32)
            ),
        )

    def _abstract_draft_kv(self, num_blocks: int) -> KVCaches:
        return [] if self.drafter is None else self.drafter.kv_spec.abstract(num_blocks, self.kv_cache_sharding)

    def _step_inputs(self, shape: StepShape, num_blocks: int) -> tuple:
        """Abstract arguments every step program starts with: parameters, caches, state, step buffer."""
        return (
            self._abstract(self._param_leaves),
            self._abstract(self._draft_leaves),
            self.kv_cache_spec.abstract(num_blocks, self.kv_cache_sharding),
            self._abstract_draft_kv(num_blocks),
            self._abstract(self.device_state),
            self._input((shape.buffer_words,), jnp.int32),
        )

    def _lower_forward(self, num_tokens: int, num_blocks: int) -> jax.stages.Lowered:
        shape = self._step_shape(num_tokens)
        cache, whole = self.kv_cache_sharding, self.replicated
        forward_jit = jax.jit(
            functools.partial(step_functions.forward, self._statics, shape=shape), donate_argnums=(2, 3, 4),
            out_shardings=(cache, cache, whole, whole, whole, whole),
        )
        return forward_jit.lower(*self._step_inputs(shape, num_blocks))

    def _lower_decode_steps(self, num_tokens: int, num_rows: int, num_steps: int) -> jax.stages.Lowered:
        shape = self._step_shape(num_tokens)
        cache, whole = self.kv_cache_sharding, self.replicated
        steps_jit = jax.jit(
            functools.partial(
                step_functions.decode_steps, self._statics, shape=shape, num_rows=num_rows, num_steps=num_steps
            ),
            donate_argnums=(2, 3, 4), out_shardings=(cache, cache, whole, whole),
        )
        return steps_jit.lower(*self._step_inputs(shape, self.num_blocks))

    # ------------------------------------------------------------ request state

    def finish_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Free the slots of the requests the scheduler finished or preempted."""
        done = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        for req_id in done:
            slot = self.req_states.req_id_to_index.get(req_id)
            if slot is not None:
                self.block_tables.clear(slot)
                self.req_states.remove_request(req_id)
            self._prompt_logprob_requests.pop(req_id, None)

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Give new (and resumed) requests slots and block tables, and write their rows to the device."""
        for new_req in scheduler_output.scheduled_new_reqs:
            slot = self.req_states.add_request(new_req)
            k = new_req.sampling_params.prompt_logprobs
            if k is not None:
                self._prompt_logprob_requests[new_req.req_id] = (np.asarray(new_req.prompt_token_ids, np.int32), k)
            block_ids = new_req.block_ids[0] if new_req.block_ids else []
            self.block_tables.append_block_ids(slot, list(block_ids), overwrite=True)
        num_new = self.req_states.num_staged
        if num_new:
            bucket = pad_to_bucket(num_new, self.request_buckets, "new requests")
            rows = self.req_states.take_staged_rows(bucket)
            self.device_state = self._call(self._write_programs.get(bucket), self.device_state, rows)

    def update_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Append the blocks the scheduler gave running requests this step."""
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_block_ids is None:
                continue
            slot = self._slot_of(req_id)
            self.block_tables.append_block_ids(slot, list(new_block_ids[0]), overwrite=False)

    def _slot_of(self, req_id: str) -> int:
        slot = self.req_states.req_id_to_index.get(req_id)
        if slot is None:
            raise _not_on_runner(req_id)
        return slot

    # ------------------------------------------------------------------- steps

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> tuple[InputBatch, np.ndarray]:
        """Order the batch (decodes first), pick buckets and pack the step buffer (of one step of a round)."""
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
        if steps != 1 and steps not in self.config.scheduler_config.decode_step_counts:  # 1 always is
            raise ValueError(
                f"num_decode_steps is {steps}; this runner runs rounds of "
                f"{self.config.scheduler_config.decode_step_counts} steps (SchedulerConfig.num_scheduler_steps)."
            )
        if steps > 1:
            self._check_decode_round(req_ids, num_scheduled, computed, idx_mapping, scheduler_output)
            num_scheduled = np.ones_like(num_scheduled)  # one token a step
        num_tokens = int(num_scheduled.sum())
        if (seq_lens > self.max_model_len).any():
            bad = req_ids[int(np.argmax(seq_lens > self.max_model_len))]
            raise ValueError(
                f"Request {bad!r} would reach {int(seq_lens.max())} tokens, past max_model_len "
                f"({self.max_model_len})."
            )
        token_bucket = pad_to_bucket(num_tokens, self.token_buckets, "tokens")
        request_bucket = pad_to_bucket(len(req_ids), self.request_buckets, "requests")
        shape = self._step_shape(token_bucket)
        appends = self.block_tables.take_staged(shape.append_capacity)
        drafts, num_drafts = self._drafts(req_ids, scheduler_output.scheduled_spec_decode_tokens)
        buffer = pack_step_buffer(shape, idx_mapping, num_scheduled, drafts, appends, self.max_num_reqs)
        is_sampling = seq_lens >= self.req_states.prefill_len[idx_mapping]
        batch = InputBatch(
            req_ids=req_ids,
            idx_mapping_np=idx_mapping,
            num_scheduled_tokens=num_scheduled,
            num_tokens=num_tokens,
            num_tokens_after_padding=token_bucket,
            num_reqs_after_padding=request_bucket,
            is_sampling_np=is_sampling,
            num_drafts=num_drafts,
            num_steps=steps,
        )
        return batch, buffer

    def _drafts(self, req_ids: list[str], spec: dict[str, list[int]]) -> tuple[list[list[int]], np.ndarray]:
        """Each request's draft tokens to verify, and their counts; no lists (and zero counts) when
        no request has drafts, as in most steps."""
        if not spec:
            return [], np.zeros(len(req_ids), np.int32)
        drafts = [spec.get(r, []) for r in req_ids]
        num_drafts = np.array([len(d) for d in drafts], np.int32)
        if num_drafts.max() > self.num_spec:
            raise ValueError(
                f"A request carries more than num_speculative_tokens ({self.num_spec}) draft tokens."
            )
        return drafts, num_drafts

    def _check_decode_round(
        self, req_ids: list[str], num_scheduled: np.ndarray, computed: np.ndarray, idx_mapping: np.ndarray,
        scheduler_output: SchedulerOutput,
    ) -> None:
        """Raise ValueError unless a round of several decode steps gives each request one token a
        step, no drafts, a first step that samples (its prompt is in, but for one token at most),
        and the plain sampling program (no stage before the draw, no logprobs)."""
        steps = scheduler_output.num_decode_steps
        if scheduler_output.scheduled_spec_decode_tokens or np.any(num_scheduled != steps):
            raise ValueError(
                f"A round of {steps} decode steps schedules exactly {steps} tokens (one a step) for each "
                "request, and no draft tokens."
            )
        prefilling = computed + 1 < self.req_states.prefill_len[idx_mapping]
        if np.any(prefilling):
            raise ValueError(
                f"Request {req_ids[int(np.argmax(prefilling))]!r} is still prefilling; a round of several "
                "decode steps takes only requests whose first step samples."
            )
        plain = self.req_states.plain_sampling[idx_mapping] & (self.req_states.num_logprobs[idx_mapping] == 0)
        if not plain.all():
            raise ValueError(
                f"Request {req_ids[int(np.argmin(plain))]!r} uses a sampling stage before the draw or "
                "logprobs; a round of several decode steps takes only plainly sampled requests."
            )

    def _call(self, program: jax.stages.Compiled, *args):
        """Call a compiled program, adding how long the call holds this thread to ``program_call_s``."""
        start = time.perf_counter()
        try:
            with self.spans("program_call"):
                return program(*args)
        finally:
            self.program_call_s += time.perf_counter() - start

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Update request state and dispatch the forward step; ``sample_tokens`` finishes it."""
        if self.kv_caches is None:
            raise RuntimeError("initialize_kv_cache() must run before execute_model().")
        self.finish_requests(scheduler_output)
        self.add_requests(scheduler_output)
        self.update_requests(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.make_empty()
        with self.spans("prepare_inputs"):
            batch, buffer = self.prepare_inputs(scheduler_output)
        if batch.num_steps > 1:
            self.execute_model_state = self._run_decode_steps(batch, buffer)
            return None
        program = self._forward_programs.get(batch.num_tokens_after_padding)
        self.kv_caches, self.draft_kv_caches, self.device_state, sample_hidden, rows, hidden = self._call(
            program, self._param_leaves, self._draft_leaves, self.kv_caches, self.draft_kv_caches, self.device_state,
            buffer,
        )
        self.execute_model_state = _Dispatched(batch, sample_hidden, rows, hidden)
        return None

    def _run_decode_steps(self, batch: InputBatch, buffer: np.ndarray) -> _Dispatched:
        """Dispatch a round of several decode steps: forward and plain sampling, in one program."""
        key = (batch.num_tokens_after_padding, batch.num_reqs_after_padding, batch.num_steps)
        self.kv_caches, self.draft_kv_caches, self.device_state, tokens = self._call(
            self._decode_steps_programs.get(key), self._param_leaves, self._draft_leaves, self.kv_caches,
            self.draft_kv_caches, self.device_state, buffer,
        )
        return _Dispatched(batch, tokens=tokens)

    @property
    def use_async_scheduling(self) -> bool:
        """Whether ``sample_tokens`` returns before the tokens reach the host.

        Verification of drafts needs the accepted counts on the host before the
        next step, so speculative decoding always runs one step at a time.
        """
        return self.config.scheduler_config.async_scheduling and self.num_spec == 0

    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the step dispatched by ``execute_model``.

        Returns its ``ModelRunnerOutput``, or with async scheduling an
        ``AsyncModelRunnerOutput`` whose device-to-host copy is under way: the
        next step can be dispatched before ``get_output()`` waits for it. A batch
        whose requests all sample from temperature alone, with no logprobs and no
        grammar, runs the plain sampling program, which has no conditionals.
        """
        if self.execute_model_state is None:
            raise RuntimeError("sample_tokens() called without a preceding execute_model().")
        dispatched, self.execute_model_state = self.execute_model_state, None
        batch = dispatched.batch
        if dispatched.tokens is not None:  # a round of decode steps, sampled in its own program
            output = self._finish(_PendingOutput(self, batch, dispatched.tokens, None, {}))
            if _uses_grammar(grammar_output):
                raise ValueError(
                    "A round of several decode steps samples without a grammar; its tokens were not constrained. "
                    "Run structured-output requests one step at a time."
                )
            return output
        sample_hidden, rows, hidden = dispatched.sample_hidden, dispatched.rows, dispatched.hidden
        bucket = batch.num_reqs_after_padding
        bitmask, active = self._grammar_rows(batch, grammar_output)
        wants_logprobs = bool(((self.req_states.num_logprobs[batch.idx_mapping_np] > 0) & batch.is_sampling_np).any())
        plain = (
            self.num_spec == 0 and not wants_logprobs and not _uses_grammar(grammar_output)
            and bool(self.req_states.plain_sampling[batch.idx_mapping_np].all())
        )
        program = self._sample_programs.get((bucket, plain))
        self.draft_kv_caches, self.device_state, tokens, logprobs = self._call(
            program, self._param_leaves, self._draft_leaves, self.draft_kv_caches, sample_hidden, rows, self.device_state,
            bitmask, active,
        )
        return self._finish(_PendingOutput(
            self, batch, tokens, logprobs if wants_logprobs else None, self._prompt_logprobs_of(batch, hidden)
        ))

    def _finish(self, pending: _PendingOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's output: pending under async scheduling, else waited for."""
        if self.use_async_scheduling:
            self._advance_computed(pending.batch, None)
            return pending
        output = pending.get_output()
        self._advance_computed(pending.batch, output.sampled_token_ids)
        return output

    def _advance_computed(self, batch: InputBatch, sampled: list[list[int]] | None) -> None:
        """The host's num_computed_tokens: the scheduled tokens, less the rejected drafts."""
        advance = batch.num_scheduled_tokens * batch.num_steps
        if sampled is not None and batch.num_drafts.any():
            rejected = [d - (len(t) - 1) if t else 0 for d, t in zip(batch.num_drafts, sampled)]
            advance = advance - np.asarray(rejected, np.int32)
        self.req_states.num_computed_tokens[batch.idx_mapping_np] += advance

    def _grammar_rows(self, batch: InputBatch, grammar_output: GrammarOutput | None):
        """The grammar bitmask in batch row order (a resident all-off pair when unused)."""
        bucket = batch.num_reqs_after_padding
        if not _uses_grammar(grammar_output):
            return self._no_grammar[bucket]
        row_of = {r: i for i, r in enumerate(batch.req_ids)}
        bitmask = np.zeros((bucket, bitmask_words(self.vocab_size)), np.int32)
        active = np.zeros(bucket, np.bool_)
        for req_id, words in zip(grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask):
            if req_id in row_of:
                bitmask[row_of[req_id], : len(words)] = words
                active[row_of[req_id]] = True
        return bitmask, active

    def _prompt_logprobs_of(self, batch: InputBatch, hidden: jax.Array) -> dict[str, tuple[int, LogprobsLists]]:
        """Raw logprobs of the prompt tokens this step's chunks predict, per asking request.

        Each entry is (position of the first prompt token predicted, its rows).
        """
        if not self._prompt_logprob_requests:
            return {}
        spans = []
        start = 0
        for req_id, slot, n in zip(batch.req_ids, batch.idx_mapping_np, batch.num_scheduled_tokens):
            entry = self._prompt_logprob_requests.get(req_id)
            computed = int(self.req_states.num_computed_tokens[slot])
            if entry is not None:
                prompt, k = entry
                # Token at position p predicts prompt token p + 1.
                end = min(computed + int(n), len(prompt) - 1)
                if end > computed:
                    spans.append((req_id, start, computed, end, prompt, k))
            start += int(n)
        if not spans:
            return {}
        size = batch.num_tokens_after_padding
        targets, counts = np.zeros(size, np.int32), np.zeros(size, np.int32)
        for _, start, first, end, prompt, k in spans:
            targets[start : start + end - first] = prompt[first + 1 : end + 1]
            counts[start : start + end - first] = k + 1
        out = self._call(self._prompt_logprob_programs.get(size), self._param_leaves, hidden, targets, counts)
        ids, lps, ranks = (host_copy(a) for a in (out.token_ids, out.logprobs, out.ranks))
        result = {}
        for req_id, start, first, end, _, k in spans:
            rows = slice(start, start + end - first)
            result[req_id] = (first + 1, LogprobsLists(ids[rows, : k + 1], lps[rows, : k + 1], ranks[rows]))
        return result

    def samples_plainly(self, params: SamplingParams) -> bool:
        """Whether requests with these parameters take the plain sampling program (no stage before
        the draw, no logprobs), as a round of several decode steps needs."""
        fields = pack_sampling_params(params, random.Random(0), self.config.sampler_config, self.vocab_size)
        return fields["num_logprobs"] == 0 and not uses_sampling_stages(fields)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Raise ValueError if the runner cannot hold these parameters (capacities, token ids)."""
        pack_sampling_params(params, random.Random(0), self.config.sampler_config, self.vocab_size)
        check_logprobs_count("prompt_logprobs", params.prompt_logprobs, self.config.sampler_config)


def _uses_grammar(grammar_output: GrammarOutput | None) -> bool:
    return grammar_output is not None and bool(grammar_output.structured_output_request_ids)


def _not_on_runner(req_id: str) -> ValueError:
    return ValueError(f"Request {req_id!r} is scheduled but not on the runner; schedule it first as a new request.")


class _PendingOutput(AsyncModelRunnerOutput):
    """A dispatched step's output: device arrays, read on the host when ``get_output`` asks.

    No copy is started at dispatch: under async scheduling the host asks only after it
    has dispatched the next step, so a copy started early saves the host nothing, and
    starting it held the engine's thread about 0.15 ms a step on an H100's host.
    """

    def __init__(
        self, runner: ModelRunner, batch: InputBatch, tokens: jax.Array, logprobs: LogprobsTensors | None,
        prompt_logprobs: dict[str, tuple[int, LogprobsLists]],
    ):
        self.runner = runner
        self.batch = batch
        self.tokens = tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    def get_output(self) -> ModelRunnerOutput:
        """Wait for the step's tokens on the host and build its ``ModelRunnerOutput``."""
        with self.runner.spans("get_output"):
            return self._get_output()

    def _get_output(self) -> ModelRunnerOutput:
        batch = self.batch
        start = time.perf_counter()
        with self.runner.spans("device_wait"):
            tokens = host_copy(self.tokens)  # blocks until the step has run and its tokens are copied
        self.runner.device_wait_s += time.perf_counter() - start
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index=dict(zip(batch.req_ids, range(batch.num_reqs))),
            sampled_token_ids=self._sampled_token_ids(tokens[: batch.num_reqs]),
            logprobs=None if self.logprobs is None else self._logprobs_lists(),
            prompt_logprobs_dict=self.prompt_logprobs,
        )

    def _sampled_token_ids(self, rows: np.ndarray) -> list[list[int]]:
        """Each request's sampled tokens: its row's ids (-1 pads rejected drafts), none if it did not sample.

        Most steps every request samples and keeps its whole row: one ``tolist`` then.
        """
        is_sampling = self.batch.is_sampling_np
        if is_sampling.all() and rows.min(initial=0) >= 0:
            return rows.tolist()
        return [[t for t in row if t >= 0] if s else [] for row, s in zip(rows.tolist(), is_sampling.tolist())]

    def _logprobs_lists(self) -> LogprobsLists:
        """Sample logprobs of the rows that sampled."""
        keep = np.flatnonzero(self.batch.is_sampling_np)
        return LogprobsLists(
            logprob_token_ids=host_copy(self.logprobs.token_ids)[keep],
            logprobs=host_copy(self.logprobs.logprobs)[keep],
            sampled_token_ranks=host_copy(self.logprobs.ranks)[keep],
            cu_num_generated_tokens=np.concatenate([[0], np.cumsum(self.batch.is_sampling_np)]).tolist(),
        )
