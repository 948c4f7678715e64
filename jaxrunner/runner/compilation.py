"""The one owner of what the runner compiles, and how.

Static-shape bucketing plays the role CUDA graphs play in vLLM: every step
runs one of a fixed set of programs, compiled ahead of time. This module holds
the bucket ladders, lowers each program with its donations and output
shardings, compiles it with XLA's options for its size, precompiles them all
(``capture_model``), measures the largest steps' activations (``profile_run``),
and counts compiles: a compile after warm-up is a bug. It is built from
explicit inputs (the programs' statics, the abstract shapes and shardings of
their arguments, the configuration) and holds nothing of the runner.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring
from tqdm.auto import tqdm

from jaxrunner.compat import device_memory_stats
from jaxrunner.config import CompilationConfig
from jaxrunner.models.lora import LoRAWeights, set_slot
from jaxrunner.models.quantization import Fp8Config
from jaxrunner.ops.fp8_matmul import fp8_matmul_impl
from jaxrunner.runner import step_functions
from jaxrunner.runner.block_table import BlockTables
from jaxrunner.runner.input_batch import SampleRows, StepShape, pack_step_buffer
from jaxrunner.runner.kv_cache import KVCacheSpec
from jaxrunner.runner.kv_connector.block_copies import gather_blocks, scatter_blocks
from jaxrunner.runner.packed_rows import RowLayout
from jaxrunner.runner.states import DeviceState, write_new_requests
from jaxrunner.runner.step_functions import ParamLeaves, StepStatics
from jaxrunner.sample.sampling_state import bitmask_words

logger = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# Blocks of the throw-away KV cache the profile run compiles against and runs on.
_PROFILE_NUM_BLOCKS = 16

CompilerOptions = dict[str, str | bool | int]

# Tracing and lowering are Python (they hold the GIL throughout) and go through Flax's and JAX's tracing state:
# one thread lowers at a time; XLA's compilation, which releases the GIL, runs on as many threads as precompile has.
_LOWERING = threading.Lock()


def _compile(lowered: jax.stages.Lowered, options: CompilerOptions) -> jax.stages.Compiled:
    """``lowered.compile`` with XLA's ``options``."""
    # jax annotates compiler_options as dict[str, str | bool], yet XLA's option overrides take ints as well.
    return lowered.compile(compiler_options=options)  # pyright: ignore[reportArgumentType]


def _allocated_bytes(program: jax.stages.Compiled) -> int:
    """What ``program`` allocates when it runs, by XLA's memory analysis: its temporaries and its
    outputs not aliased to donated inputs (0 where the backend gives no analysis)."""
    analysis = program.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


# jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
def _stats(device: jax.Device) -> dict[str, int]:  # pyright: ignore[reportInvalidTypeForm]
    """``device``'s allocator statistics, on a device known to keep them."""
    stats = device_memory_stats(device)
    assert stats is not None, "the profile run measures only on devices that keep memory statistics"
    return stats


# jax.Device: see _stats.
def _hold_up_to_peak(device: jax.Device) -> jax.Array | None:  # pyright: ignore[reportInvalidTypeForm]
    """Hold, in one array, what the allocator's peak so far exceeds what is in use, so that whatever
    runs next raises the peak: JAX cannot reset it, and an earlier, higher one (while loading, say)
    would hide the next. None when nothing is hidden."""
    stats = _stats(device)
    hidden = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
    return jnp.zeros(hidden, jnp.uint8, device=device) if hidden > 0 else None


@dataclasses.dataclass(frozen=True)
class ActivationPeak:
    """What the largest steps take beyond the weights, the caches and the request state, while they run.

    ``measured_bytes`` is the allocator's peak while the profile run ran, less what
    was in use before it; None where the backend keeps no statistics (the CPU) or the
    run did not fit beside an earlier peak's hold (``_hold_up_to_peak``). ``xla_bytes``,
    what the two programs allocate by XLA's memory analysis as if both at once, stands
    in then and cross-checks the measurement otherwise.
    """

    xla_bytes: int
    measured_bytes: int | None

    @property
    def bytes(self) -> int:
        """The measured peak, or XLA's where nothing was measured."""
        return self.xla_bytes if self.measured_bytes is None else self.measured_bytes


# ---------------------------------------------------------------- ladders


def default_ladder(max_size: int) -> list[int]:
    """Bucket sizes up to ``max_size``: dense where decode batches live, sparse above.

    1, 2, 4, 8, then steps of 8 to 64, 16 to 256, then two sizes per octave
    (256, 384, 512, 768, ...). ``max_size`` itself is always the last bucket.
    """
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 65, 8)) + list(range(80, 257, 16))
    octave = 256
    while octave < max_size:
        sizes += [octave + octave // 2, octave * 2]
        octave *= 2
    return sorted({s for s in sizes if s < max_size} | {max_size})


def power_of_two_ladder(max_size: int) -> list[int]:
    """The powers of two below ``max_size``, and it."""
    return sorted({1 << i for i in range(max_size.bit_length()) if 1 << i < max_size} | {max_size})


def make_ladder(requested: Iterable[int] | None, max_size: int, name: str) -> list[int]:
    """The configured ladder, checked, or the default one; it always reaches ``max_size``."""
    if requested is None:
        return default_ladder(max_size)
    ladder = sorted(set(int(b) for b in requested))
    if ladder[-1] < max_size:
        raise ValueError(
            f"CompilationConfig.{name} must reach {max_size} (the scheduler's limit); "
            f"its largest bucket is {ladder[-1]}. Add {max_size} to the ladder."
        )
    return ladder


def encoder_ladder(max_patches: int, merge_area: int) -> list[int]:
    """Patch buckets of the image encoder: 64, 96, 128, 192, 256, ... (two a octave) up to ``max_patches``,
    each a multiple of ``merge_area``: an image pads by at most half, in attention that grows as its square."""
    sizes, size = [], 64
    while size < max_patches:
        sizes += [size, size * 3 // 2]
        size *= 2
    top = -(-max_patches // merge_area) * merge_area
    return sorted({-(-s // merge_area) * merge_area for s in sizes if s < top} | {top})


def pad_to_bucket(size: int, ladder: list[int], what: str) -> int:
    """The smallest bucket that holds ``size``; a clear error past the largest."""
    i = bisect.bisect_left(ladder, size)
    if i == len(ladder):
        raise ValueError(
            f"A batch of {size} {what} exceeds the largest bucket ({ladder[-1]}). "
            f"Raise the scheduler limit and the bucket ladder, or schedule fewer {what} per step."
        )
    return ladder[i]


# ------------------------------------------------- process-wide compilation


class CompileCounter:
    """Counts every XLA program JAX builds in this process (compiled or read from cache).

    JAX reports each backend compilation through ``jax.monitoring``; counting
    that event catches compiles our own code does not know it triggers, such
    as an eager op on a new shape.
    """

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        """Start counting backend compiles (once per process; later calls do nothing)."""
        with cls._lock:
            if cls._installed:
                return
            monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with cls._lock:
                cls._count += 1

    @classmethod
    def count(cls) -> int:
        """Backend compiles since ``install``."""
        cls.install()
        return cls._count


def enable_compilation_cache(cache_dir: str) -> None:
    """Count compiles from now on, and keep every program in JAX's persistent cache at ``cache_dir`` ("": off).

    JAX skips programs that compile in under a second by default, which would
    leave the small sampling programs uncached.
    """
    CompileCounter.install()
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# ------------------------------------------------------------------ programs


class CompiledPrograms:
    """Ahead-of-time compiled programs of one jitted function, one per bucket.

    ``get(bucket)`` returns the program for a bucket, compiling it on first
    use; ``num_compiled`` counts the buckets compiled so far.
    """

    def __init__(
        self,
        name: str,
        lower: Callable[[Any], jax.stages.Lowered],
        compiler_options: Callable[[Any], CompilerOptions] = lambda bucket: {},
    ):
        self.name = name
        self._lower = lower
        self._compiler_options = compiler_options
        self._programs: dict[Hashable, jax.stages.Compiled] = {}

    def get(self, bucket: Hashable) -> jax.stages.Compiled:
        """The program for ``bucket``, lowered and compiled (with the bucket's ``compiler_options``) on first use."""
        program = self._programs.get(bucket)
        if program is None:
            with _LOWERING:
                lowered = self._lower(bucket)
            program = _compile(lowered, self._compiler_options(bucket))
            self._programs[bucket] = program
        return program

    @property
    def num_compiled(self) -> int:
        """How many buckets have a compiled program."""
        return len(self._programs)

    def memory_bytes(self) -> dict[str, dict[str, int]]:
        """XLA's memory analysis of each compiled program, by bucket: argument, output, aliased
        (donated inputs reused as outputs) and temporary bytes. A program whose temporaries hold a
        copy of its donated inputs shows it here before it runs out of memory."""
        sizes = {}
        for bucket, program in self._programs.items():
            analysis = program.memory_analysis()
            if analysis is not None:
                sizes[str(bucket)] = {
                    field: int(getattr(analysis, f"{field}_size_in_bytes"))
                    for field in ("argument", "output", "alias", "temp", "generated_code")
                }
        return sizes


def abstract(tree: Any) -> Any:
    """Shape, dtype and sharding of every array in ``tree``."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


@dataclasses.dataclass(frozen=True)
class ProgramInputs:
    """Shapes, dtypes and shardings of the step programs' arguments: all that lowering them needs."""

    params: list[jax.ShapeDtypeStruct]  # the model's parameter leaves
    draft_params: list[jax.ShapeDtypeStruct]  # the drafter's (empty without one)
    device_state: DeviceState  # of ShapeDtypeStructs
    kv_cache: KVCacheSpec
    draft_kv_cache: KVCacheSpec | None
    hidden: jax.ShapeDtypeStruct  # one token's hidden state, [E]
    new_request_layout: RowLayout
    vocab_size: int
    cache_sharding: jax.sharding.Sharding  # the KV caches': split on KV heads
    replicated: jax.sharding.Sharding  # everything else's
    lora_weights: LoRAWeights | None = None  # the LoRA slots' B (of ShapeDtypeStructs); None: LoRA off
    lora_kernels: dict[tuple[int, str], jax.ShapeDtypeStruct] | None = None  # the parameters that carry the slots' A
    encoder_cache: jax.ShapeDtypeStruct | None = None  # a vision-language model's encoder outputs, [rows, E]
    patch_features: int = 0  # features of one image patch, what the vision encoder reads
    max_image_patches: int = 0  # the largest image the encoder takes, in patches (a multiple of merge_area)
    merge_area: int = 1  # patches merged into one placeholder token
    max_moved_blocks: int = 0  # a KV connector's largest copy of blocks (0: no connector)


class CompilationManager:
    """The runner's programs, one per bucket: lowered, compiled and precompiled here.

    ``forward`` (token bucket), ``sample`` ((request bucket, plain path)),
    ``write_new_requests`` (request bucket), ``decode_steps`` ((token bucket,
    request bucket, steps)), ``prompt_logprobs`` (token bucket), with LoRA
    ``set_lora_slot`` (one program, key None, for every slot), and for a
    vision-language model ``encode_image`` (patch bucket: one image a call), and
    with a KV connector ``kv_gather`` and ``kv_scatter`` (bucket of blocks). Programs that
    take the KV cache are lowered for ``num_blocks`` blocks, set once the cache is
    sized. With LoRA the forward programs take the slots' B as an argument (not
    donated) and their A in the parameters, so loading an adapter changes inputs, never a program.
    """

    def __init__(
        self,
        config: CompilationConfig,
        statics: StepStatics,
        inputs: ProgramInputs,
        *,
        max_num_tokens: int,
        decode_step_counts: tuple[int, ...],
        fp8: Fp8Config | None = None,
    ):
        self.config = config
        self.fp8 = fp8
        self.statics = statics
        self.inputs = inputs
        self.decode_step_counts = decode_step_counts
        self.token_buckets = make_ladder(config.token_buckets, max_num_tokens, "token_buckets")
        self.request_buckets = make_ladder(config.request_buckets, statics.max_num_reqs, "request_buckets")
        self.step_shapes = {b: self._step_shape(b) for b in self.token_buckets}
        self.num_blocks: int | None = None
        options, options_of_first = self.compiler_options, lambda key: self.compiler_options(key[0])
        head_options = functools.partial(self.compiler_options, decoder=False)
        self.forward = CompiledPrograms("forward", lambda b: self._lower_forward(b, self._kv_blocks()), options)
        self.sample = CompiledPrograms(
            "sample",
            lambda key: self._lower_sample(key[0], self._kv_blocks(), plain=key[1]),
            lambda key: head_options(key[0]),
        )
        self.write_new_requests = CompiledPrograms("write_new_requests", self._lower_write_new_requests)
        self.decode_steps = CompiledPrograms(
            "decode_steps", lambda key: self._lower_decode_steps(*key, num_blocks=self._kv_blocks()), options_of_first
        )
        self.prompt_logprobs = CompiledPrograms("prompt_logprobs", self._lower_prompt_logprobs, head_options)
        self.set_lora_slot = CompiledPrograms("set_lora_slot", lambda _: self._lower_set_lora_slot())
        self.encode_image = CompiledPrograms("encode_image", self._lower_encode_image)
        self.patch_buckets = self._patch_ladder()
        self.kv_gather = CompiledPrograms("kv_gather", lambda b: self._lower_kv_copy(b, gather=True))
        self.kv_scatter = CompiledPrograms("kv_scatter", lambda b: self._lower_kv_copy(b, gather=False))
        self.kv_block_buckets = power_of_two_ladder(inputs.max_moved_blocks) if inputs.max_moved_blocks else []
        # Outputs keep the inputs' layout: caches split on KV heads, everything else replicated.
        cache, whole = inputs.cache_sharding, inputs.replicated
        self._sample_jit = jax.jit(
            functools.partial(step_functions.sample_step, statics),
            static_argnames=("num_rows", "plain"),
            donate_argnums=(2, 5),
            out_shardings=(cache, whole, whole, whole),
        )

    def _patch_ladder(self) -> list[int]:
        """The encoder's patch buckets (none for a text model): the configured ones, checked, or the default."""
        inputs = self.inputs
        if inputs.encoder_cache is None:
            return []
        if self.config.patch_buckets is None:
            return encoder_ladder(inputs.max_image_patches, inputs.merge_area)
        ladder = make_ladder(self.config.patch_buckets, inputs.max_image_patches, "patch_buckets")
        if any(b % inputs.merge_area for b in ladder):
            raise ValueError(
                f"CompilationConfig.patch_buckets must be multiples of {inputs.merge_area} (the patches merged into "
                f"one token); got {ladder}."
            )
        return ladder

    @property
    def programs(self) -> tuple[CompiledPrograms, ...]:
        programs = (self.forward, self.sample, self.write_new_requests, self.decode_steps, self.prompt_logprobs)
        programs += (self.set_lora_slot,) if self.inputs.lora_weights is not None else ()
        programs += (self.kv_gather, self.kv_scatter) if self.kv_block_buckets else ()
        return programs + ((self.encode_image,) if self.patch_buckets else ())

    def compiler_options(self, num_rows: int, decoder: bool = True) -> CompilerOptions:
        """XLA's options for a step program over ``num_rows`` rows (tokens, or requests to sample); ``decoder``:
        the program runs the decoder's layers, whose FP8 weights may decide its GEMMs, not only the LM head."""
        fp8 = self.fp8 if decoder else None
        weight_only = fp8 is not None and fp8_matmul_impl(num_rows, fp8.activations, fp8.matmul) == "weight_only"
        return self.config.step_compiler_options(num_rows, fp8_weight_only=weight_only)

    def token_bucket(self, num_tokens: int) -> int:
        return pad_to_bucket(num_tokens, self.token_buckets, "tokens")

    def request_bucket(self, num_reqs: int, what: str = "requests") -> int:
        return pad_to_bucket(num_reqs, self.request_buckets, what)

    def kv_block_bucket(self, num_blocks: int) -> int:
        return pad_to_bucket(num_blocks, self.kv_block_buckets, "KV blocks")

    def patch_bucket(self, num_patches: int) -> int:
        return pad_to_bucket(num_patches, self.patch_buckets, "image patches")

    # ------------------------------------------------------------ precompile

    def capture_model(self) -> float:
        """Precompile every program of every bucket (the counterpart of CUDA graph capture); returns seconds.

        Programs are lowered one at a time and compiled by ``compile_threads`` threads at once (with one, on
        the caller's thread: JAX's context managers are per thread).
        """
        start = time.perf_counter()
        jobs = [(self.forward, b) for b in self.token_buckets]
        jobs += [(self.sample, (b, plain)) for b in self.request_buckets for plain in self.sample_paths]
        jobs += [(self.write_new_requests, b) for b in self.request_buckets]
        jobs += [(self.decode_steps, key) for key in self.decode_steps_keys()]
        jobs += [(self.prompt_logprobs, b) for b in self.token_buckets]
        jobs += [(self.set_lora_slot, None)] if self.inputs.lora_weights is not None else []
        jobs += [(self.encode_image, b) for b in self.patch_buckets]
        jobs += [(programs, b) for b in self.kv_block_buckets for programs in (self.kv_gather, self.kv_scatter)]
        with tqdm(total=len(jobs), desc="Precompiling buckets", leave=False) as progress:
            if self.config.compile_threads == 1:  # on the caller's thread, under its JAX contexts
                for programs, bucket in jobs:
                    programs.get(bucket)
                    progress.update()
            else:
                with concurrent.futures.ThreadPoolExecutor(self.config.compile_threads) as pool:
                    compiling = [pool.submit(programs.get, bucket) for programs, bucket in jobs]
                    try:
                        for done in concurrent.futures.as_completed(compiling):
                            done.result()
                            progress.update()
                    finally:
                        pool.shutdown(cancel_futures=True)
        return time.perf_counter() - start

    @property
    def sample_paths(self) -> tuple[bool, ...]:
        """The sampling programs' ``plain`` values: the plain path exists without drafts only."""
        return (False,) if self.statics.num_spec else (False, True)

    def decode_steps_keys(self) -> list[tuple[int, int, int]]:
        """(token bucket, request bucket, steps) of every round of several decode steps the scheduler can make."""
        largest = min(self.statics.max_num_reqs, self.token_buckets[-1])
        buckets = {(self.token_bucket(n), self.request_bucket(n)) for n in range(1, largest + 1)}
        return [(t, r, k) for t, r in sorted(buckets) for k in self.decode_step_counts[1:]]

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled so far over all buckets (flat after ``capture_model``)."""
        return sum(p.num_compiled for p in self.programs)

    def program_memory_bytes(self) -> dict[str, dict[str, dict[str, int]]]:
        """XLA's memory analysis of every compiled program, by kind and bucket."""
        return {p.name: p.memory_bytes() for p in self.programs}

    def profile_run(
        self,
        params: ParamLeaves,
        draft_params: ParamLeaves,
        # jax/__init__.py assigns jax.Device (``Device = _xc.Device``), which pyright takes for a variable.
        device: jax.Device,  # pyright: ignore[reportInvalidTypeForm]
    ) -> ActivationPeak:
        """The activation peak of the largest steps on ``device``: their forward and sampling programs, run once,
        then a vision-language model's encoder on the largest image.

        The programs are compiled for a throw-away cache of ``_PROFILE_NUM_BLOCKS``
        blocks (a cache is donated in place, so its size adds no temporaries) and run
        as the engine runs them, one after the other, on zeroed caches and state and a
        step of the largest token bucket over as many requests as it holds. XLA's
        buffers depend on shapes only, so dummy values take the memory real ones do.
        The measurement is the allocator's peak over what was in use before, an earlier,
        higher peak held first (``_hold_up_to_peak``). Where the backend keeps no memory
        statistics (the CPU) nothing runs.
        """
        tokens, reqs = self.token_buckets[-1], self.request_buckets[-1]
        forward = _compile(self._lower_forward(tokens, _PROFILE_NUM_BLOCKS), self.compiler_options(tokens))
        sample = _compile(self._lower_sample(reqs, _PROFILE_NUM_BLOCKS), self.compiler_options(reqs, decoder=False))
        xla_bytes = _allocated_bytes(forward) + _allocated_bytes(sample)
        encode = None
        if self.patch_buckets:
            encode = _compile(self._lower_encode_image(self.patch_buckets[-1]), {})
            xla_bytes = max(xla_bytes, _allocated_bytes(encode))
        if device_memory_stats(device) is None:
            return ActivationPeak(xla_bytes, measured_bytes=None)
        shape = self.step_shapes[tokens]
        zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
        caches, draft_caches, state = jax.tree.map(zeros, self._step_args(shape, _PROFILE_NUM_BLOCKS)[2:5])
        lora_weights, encoder_cache = jax.tree.map(zeros, (self.inputs.lora_weights, self.inputs.encoder_cache))
        logits_rows = reqs * (self.statics.num_spec + 1)
        no_grammar = (
            np.zeros((logits_rows, bitmask_words(self.inputs.vocab_size)), np.int32),
            np.zeros(logits_rows, np.bool_),
        )
        try:
            ballast = _hold_up_to_peak(device)
            in_use = _stats(device)["bytes_in_use"]
            step_buffer = self._profile_step_buffer(shape)
            _, draft_caches, state, sample_hidden, rows, _ = forward(
                params, draft_params, caches, draft_caches, state, step_buffer, lora_weights, encoder_cache
            )
            jax.block_until_ready(sample(params, draft_params, draft_caches, sample_hidden, rows, state, *no_grammar))
            if encode is not None:
                patches = self.patch_buckets[-1]
                int_zeros = lambda *shape: np.zeros(shape, np.int32)
                jax.block_until_ready(
                    encode(
                        params,
                        encoder_cache,
                        np.zeros((patches, self.inputs.patch_features), np.float32),
                        int_zeros(patches, 2),
                        int_zeros(patches),
                        int_zeros(patches),
                        int_zeros(patches // self.inputs.merge_area),
                    )
                )
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            logger.warning("Profile run out of memory beside an earlier peak's hold; XLA's analysis stands in.")
            return ActivationPeak(xla_bytes, measured_bytes=None)
        measured = _stats(device)["peak_bytes_in_use"] - in_use
        del ballast  # held until the peak was read
        logger.info("Profile run: %.3f GiB at peak (XLA's analysis: %.3f GiB)", measured / 2**30, xla_bytes / 2**30)
        return ActivationPeak(xla_bytes, measured_bytes=measured)

    def _profile_step_buffer(self, shape: StepShape) -> np.ndarray:
        """The step buffer of ``shape.num_tokens`` tokens spread over ``shape.num_reqs`` requests, no block appended."""
        num_scheduled = np.full(shape.num_reqs, shape.num_tokens // shape.num_reqs, np.int32)
        num_scheduled[: shape.num_tokens % shape.num_reqs] += 1
        slots = np.arange(shape.num_reqs, dtype=np.int32)
        no_appends = np.full((3, shape.append_capacity), -1, np.int32)
        return pack_step_buffer(shape, slots, num_scheduled, [], no_appends, self.statics.max_num_reqs)

    # -------------------------------------------------------------- lowering

    def _kv_blocks(self) -> int:
        if self.num_blocks is None:
            raise RuntimeError("The KV cache is not sized yet: initialize_kv_cache() must run before compiling steps.")
        return self.num_blocks

    def _step_shape(self, num_tokens: int) -> StepShape:
        statics = self.statics
        num_reqs = min(num_tokens, statics.max_num_reqs)
        return StepShape(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            append_capacity=BlockTables.append_capacity(
                num_tokens, num_reqs, statics.block_size, statics.num_kv_cache_groups
            ),
            num_spec=statics.num_spec,
            drafts_on_device=statics.drafts_on_device,
            multimodal=self.inputs.encoder_cache is not None,
        )

    def _input(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """A step input from the host: replicated over the mesh."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.inputs.replicated)

    def _draft_kv(self, num_blocks: int) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        spec = self.inputs.draft_kv_cache
        return [] if spec is None else spec.abstract(num_blocks, self.inputs.cache_sharding)

    def _step_args(self, shape: StepShape, num_blocks: int) -> tuple:
        """Abstract arguments of the forward programs: parameters, caches, state, step buffer, LoRA slots,
        encoder cache."""
        inputs = self.inputs
        return (
            inputs.params,
            inputs.draft_params,
            inputs.kv_cache.abstract(num_blocks, inputs.cache_sharding),
            self._draft_kv(num_blocks),
            inputs.device_state,
            self._input((shape.buffer_words,), jnp.int32),
            inputs.lora_weights,
            inputs.encoder_cache,
        )

    def _lower_forward(self, num_tokens: int, num_blocks: int) -> jax.stages.Lowered:
        shape = self.step_shapes[num_tokens]
        cache, whole = self.inputs.cache_sharding, self.inputs.replicated
        forward_jit = jax.jit(
            functools.partial(step_functions.forward, self.statics, shape=shape),
            donate_argnums=(2, 3, 4),
            out_shardings=(cache, cache, whole, whole, whole, whole),
        )
        return forward_jit.lower(*self._step_args(shape, num_blocks))

    def _lower_sample(self, num_rows: int, num_blocks: int, plain: bool = False) -> jax.stages.Lowered:
        inputs, statics = self.inputs, self.statics
        hidden = self._input((statics.max_num_reqs, statics.num_spec + 1, *inputs.hidden.shape), inputs.hidden.dtype)
        rows = jax.tree.map(
            lambda a: self._input(a.shape, a.dtype), SampleRows.abstract(statics.max_num_reqs, statics.num_spec)
        )
        words = bitmask_words(inputs.vocab_size)
        logits_rows = num_rows * (statics.num_spec + 1)  # the grammar masks each logits row
        return self._sample_jit.lower(
            inputs.params,
            inputs.draft_params,
            self._draft_kv(num_blocks),
            hidden,
            rows,
            inputs.device_state,
            self._input((logits_rows, words), jnp.int32),
            self._input((logits_rows,), jnp.bool_),
            num_rows=num_rows,
            plain=plain,
        )

    def _lower_decode_steps(
        self, num_tokens: int, num_rows: int, num_steps: int, *, num_blocks: int
    ) -> jax.stages.Lowered:
        shape = self.step_shapes[num_tokens]
        cache, whole = self.inputs.cache_sharding, self.inputs.replicated
        steps_jit = jax.jit(
            functools.partial(
                step_functions.decode_steps, self.statics, shape=shape, num_rows=num_rows, num_steps=num_steps
            ),
            donate_argnums=(2, 3, 4),
            out_shardings=(cache, cache, whole, whole),
        )
        return steps_jit.lower(*self._step_args(shape, num_blocks))

    def _lower_write_new_requests(self, num_rows: int) -> jax.stages.Lowered:
        inputs = self.inputs
        write_jit = jax.jit(
            functools.partial(write_new_requests, layout=inputs.new_request_layout),
            donate_argnums=(0,),
            out_shardings=inputs.replicated,
        )
        return write_jit.lower(inputs.device_state, self._input((num_rows, inputs.new_request_layout.width), jnp.int32))

    def _lower_prompt_logprobs(self, num_tokens: int) -> jax.stages.Lowered:
        inputs = self.inputs
        prompt_logprobs_jit = jax.jit(
            functools.partial(step_functions.prompt_logprobs, self.statics), out_shardings=inputs.replicated
        )
        return prompt_logprobs_jit.lower(
            inputs.params,
            self._input((num_tokens, *inputs.hidden.shape), inputs.hidden.dtype),
            self._input((num_tokens,), jnp.int32),
            self._input((num_tokens,), jnp.int32),
        )

    def _lower_encode_image(self, num_patches: int) -> jax.stages.Lowered:
        inputs = self.inputs
        assert inputs.encoder_cache is not None, "encode_image exists for vision-language models only"
        encode_jit = jax.jit(
            functools.partial(step_functions.encode_image, self.statics),
            donate_argnums=(1,),
            out_shardings=inputs.replicated,
        )
        return encode_jit.lower(
            inputs.params,
            inputs.encoder_cache,
            self._input((num_patches, inputs.patch_features), jnp.float32),
            self._input((num_patches, 2), jnp.int32),
            self._input((num_patches,), jnp.int32),
            self._input((num_patches,), jnp.int32),
            self._input((num_patches // inputs.merge_area,), jnp.int32),
        )

    def _lower_kv_copy(self, num_moved: int, gather: bool) -> jax.stages.Lowered:
        """A connector's gather of ``num_moved`` blocks out of the KV cache, or its scatter into it (donated)."""
        inputs = self.inputs
        caches = inputs.kv_cache.abstract(self._kv_blocks(), inputs.cache_sharding)
        ids = self._input((num_moved,), jnp.int32)
        if gather:  # each block split on KV heads like the cache: each device moves its own shard
            gather_jit = jax.jit(gather_blocks, out_shardings=inputs.cache_sharding)
            return gather_jit.lower(caches, ids)
        spec = inputs.kv_cache
        block_shape = (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
        blocks = (jax.ShapeDtypeStruct(block_shape, spec.dtype, sharding=inputs.cache_sharding),)
        scatter_jit = jax.jit(scatter_blocks, donate_argnums=(0,), out_shardings=inputs.cache_sharding)
        return scatter_jit.lower(caches, ids, blocks * num_moved, blocks * num_moved)

    def _lower_set_lora_slot(self) -> jax.stages.Lowered:
        """``set_slot`` over the LoRA kernels (donated: rewritten in place) and the slots' B, a traced slot and
        one adapter's float32 arrays (``adapter_arrays``)."""
        weights, kernels = self.inputs.lora_weights, self.inputs.lora_kernels
        assert weights is not None, "set_lora_slot exists with LoRA only"
        a_shapes, b_shapes = weights.one_slot()
        one_slot = lambda shapes: {name: self._input(shape, jnp.float32) for name, shape in shapes.items()}
        set_slot_jit = jax.jit(set_slot, donate_argnums=(0,), out_shardings=self.inputs.replicated)
        return set_slot_jit.lower(kernels, weights, self._input((), jnp.int32), one_slot(a_shapes), one_slot(b_shapes))
