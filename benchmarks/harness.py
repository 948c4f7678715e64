"""What every benchmark shares: the floors, kernel timings, model shapes, runners and timing loops, and the JSON.

A figure is a ratio to a floor or a peer measured in the same run: the copy
rate (bytes read + written per second) bounds a step that reads its weights
and KV cache, the bf16 matmul rate a step that computes. ``measure_floors``
measures both; ``cupti_kernel_timings`` gives each kernel's device time on a
GPU; ``build_runner`` and ``time_decode`` drive the runner's decode step the
way the engine does; ``write_json`` stamps a result with the device, the JAX
version and the commit it was measured on.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxrunner.cli import spread_lengths
from jaxrunner.config import (
    CacheConfig,
    CompilationConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from jaxrunner.interfaces import (
    AsyncModelRunnerOutput,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models import CausalLM, TransformerConfig, init_random_model
from jaxrunner.models.builtin import BUILTIN_MODELS
from jaxrunner.models.moe import MoEConfig
from jaxrunner.models.random_lora import save_random_lora_adapter
from jaxrunner.models.rope import LinearRopeScaling, Rope
from jaxrunner.roofline import copy_bytes_per_s, matmul_flops_per_s
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.sharding import make_mesh

REPO = Path(__file__).resolve().parent.parent


def _gemma3(*, hidden_size: int, head_dim: int, num_layers: int, **sizes) -> TransformerConfig:
    """A Gemma 3 (text) shape: 5 sliding-window layers to 1 global, local RoPE base 10k, GeLU-tanh, sandwich
    norms, embeddings scaled by sqrt(hidden_size) and queries by 1/sqrt(head_dim)."""
    return TransformerConfig(
        hidden_size=hidden_size,
        head_dim=head_dim,
        num_layers=num_layers,
        local_rope=Rope(10000.0),
        tie_word_embeddings=True,
        qk_norm=True,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)),
        hidden_act="gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        embed_scale=hidden_size**0.5,
        query_pre_attn_scalar=float(head_dim),
        **sizes,
    )


SHAPES: dict[str, TransformerConfig] = {
    "llama3-8b": BUILTIN_MODELS["random-llama3-8b"],
    "llama3-70b": BUILTIN_MODELS["random-llama3-70b"],
    # Llama-3-8B's structure (32 layers, 32/8 heads of 128, 128k vocabulary) with narrow matrices: its weights
    # take microseconds to read, so a decode step's time is the fixed cost every step pays whatever the width.
    "llama3-8b-narrow": TransformerConfig(
        vocab_size=128256,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
    ),
    # The built-in tiny-llama's shape: every script runs at toy size on a CPU with it (the test suite does).
    "tiny": BUILTIN_MODELS["tiny-llama"],
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 taken a token (renormalised), q/k norms.
    "qwen3-30b-a3b": TransformerConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope=Rope(1000000.0),
        max_position_embeddings=40960,
        qk_norm=True,
        moe=MoEConfig(
            num_experts=128, top_k=8, intermediate_size=768, renormalize=True, sparse_layers=tuple(range(48))
        ),
    ),
    # Gemma-3-12B (text): 48 layers, 5 local (1024-token window, RoPE base 10k) to 1 global (1M, linear 8x).
    "gemma3-12b": _gemma3(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rope=Rope(1000000.0, LinearRopeScaling(8.0)),
        max_position_embeddings=131072,
        sliding_window=1024,
    ),
    # The same layout at toy size (5 local layers of a 32-token window to 1 global): the CPU's check.
    "tiny-gemma3": _gemma3(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope=Rope(1000000.0),
        max_position_embeddings=512,
        sliding_window=32,
    ),
}


# ------------------------------------------------------------------- results


def commit() -> str | None:
    """The checkout's commit (with ``-dirty`` when it has uncommitted changes), or None outside a git checkout."""
    try:
        run = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
        head = run("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}-dirty" if dirty else head


def device_facts() -> dict:
    """Where and on what a result was measured: the device, its count, JAX's version, the date and the commit."""
    device = jax.devices()[0]
    return dict(
        device=device.device_kind,
        platform=device.platform,
        num_devices=jax.device_count(),
        jax=jax.__version__,
        date=time.strftime("%Y-%m-%d"),
        commit=commit(),
    )


def write_json(path: str | Path, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (its folder made): every script writes its figures this way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def parse_pair(text: str) -> tuple[int, int]:
    """``"64x1024"`` -> (64, 1024): a decode case (batch x context), or requests x prompt length."""
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected AxB, e.g. 64x1024; got {text!r}")
    return int(match[1]), int(match[2])


def parse_workload(text: str) -> tuple[int, int, int]:
    """``"256x1000/1000"`` -> (256 requests, input length 1000, output length 1000)."""
    match = re.fullmatch(r"(\d+)x(\d+)/(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected REQUESTSxINPUT/OUTPUT, e.g. 256x1000/1000; got {text!r}")
    return int(match[1]), int(match[2]), int(match[3])


# -------------------------------------------------------------------- floors


def measure_floors(elements: int) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, on random data.

    The copy is JAX's jitted ``x * 2`` of ``elements`` bf16 values and, where torch
    has CUDA, torch's device-to-device copy of as many bytes; the faster one is the
    floor. The matmul is square: 8192 wide from a copy of 2**28 elements, 1024 from
    2**24, 256 below (the toy sizes a CPU runs).
    """
    n = 8192 if elements >= 1 << 28 else 1024 if elements >= 1 << 24 else 256
    floors: dict = {"jax_copy_bytes_per_s": copy_bytes_per_s(elements), "matmul_flops_per_s": matmul_flops_per_s(n)}
    floors.update(torch_copy_bytes_per_s(elements))
    floors["copy_bytes_per_s"] = max(v for k, v in floors.items() if k.endswith("copy_bytes_per_s"))
    return floors


TORCH_COPY_MAX_ELEMENTS = 1 << 27
"""torch copies at most 256 MiB: JAX's pool holds most of the GPU, and 256 MiB is five times the L2."""


def torch_copy_bytes_per_s(elements: int) -> dict[str, float | str]:
    """torch's device-to-device copy rate of ``elements`` bf16 values, at most ``TORCH_COPY_MAX_ELEMENTS``
    (read + written), or why there is none."""
    if jax.default_backend() != "gpu":
        return {"torch_copy_error": "no GPU: JAX's copy is the floor"}
    elements = min(elements, TORCH_COPY_MAX_ELEMENTS)
    try:
        import torch

        src = torch.randn(elements, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return {"torch_copy_bytes_per_s": 2 * 2 * elements / statistics.median(times)}
    except Exception as exc:  # torch missing or without CUDA: JAX's copy is the floor
        return {"torch_copy_error": repr(exc)}


# ------------------------------------------------------------- kernel times


def has_cupti() -> bool:
    """Whether kernels can be timed by CUPTI: on an NVIDIA GPU only."""
    return jax.default_backend() == "gpu"


def cupti_kernel_timings(run: Callable[[], object]) -> list[tuple[str, float]]:
    """(kernel name, milliseconds) of every kernel the GPU ran during ``run()``, from CUPTI's
    activity API, as Mosaic GPU's own profiler reads it. Raises off a GPU."""
    if not has_cupti():
        raise RuntimeError(f"CUPTI times NVIDIA GPU kernels; this backend is {jax.default_backend()!r}")
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    # A private extension module (no public name in jax's stubs); Mosaic GPU's own profiler reads CUPTI through it.
    ext = mosaic_gpu_lib._mosaic_gpu_ext  # pyright: ignore[reportPrivateImportUsage]
    ext._cupti_init()
    try:
        run()
    finally:
        timings = ext._cupti_get_timings(True)
    return timings


def ms_by_kernel(timings: list[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds per kernel name, summed over its launches."""
    total: dict[str, float] = {}
    for name, ms in timings:
        total[name] = total.get(name, 0.0) + ms
    return total


# --------------------------------------------------------- runner and steps


def fill_random(kv_caches):
    """The caches with random values, one layer at a time: each layer's zeros are freed before
    its random values are made, so the peak is the caches plus one layer's temporaries."""
    key = jax.random.key(2)
    out = []
    for i, layer in enumerate(kv_caches):
        filled = []
        for j, cache in enumerate(layer):
            shape, dtype, sharding = cache.shape, cache.dtype, cache.sharding
            cache.delete()
            make = jax.jit(
                lambda k, shape=shape, dtype=dtype: jax.random.normal(k, shape, dtype), out_shardings=sharding
            )
            filled.append(make(jax.random.fold_in(key, 2 * i + j)))
        out.append(tuple(filled))
    return out


def device_memory() -> dict[str, int]:
    """Bytes in use on the device (and the peak and limit where the backend reports them), and the
    bytes of the arrays Python still holds: a gap between the two is temporaries or leaked buffers."""
    stats = jax.devices()[0].memory_stats() or {}
    held = {"live_array_bytes": sum(a.nbytes for a in jax.live_arrays())}
    return held | {k: int(v) for k, v in stats.items() if k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def build_runner(
    model: TransformerConfig,
    batches: list[int],
    max_context: int,
    steps: int,
    scheduler_steps: int = 1,
    compiler_options: dict | None = None,
    tensor_parallel_size: int = 1,
    lora_config: LoRAConfig | None = None,
    weights: CausalLM | None = None,
    cache_dtype: str = "auto",
) -> ModelRunner:
    """A runner on a random-weight bf16 ``model``, buckets exactly ``batches``, a random KV cache for
    ``max(batches)`` requests of ``max_context`` tokens and ``steps`` rounds more, ``scheduler_steps``
    decode steps per round, its programs compiled with ``compiler_options`` (None: the runner's
    defaults), the model split over ``tensor_parallel_size`` devices, LoRA slots with ``lora_config``,
    the KV cache in ``cache_dtype`` (vLLM's ``kv_cache_dtype`` names). A ``model`` with FP8 ``quantization``
    gets random FP8 weights.
    ``weights`` (``model``'s, built by an earlier call: ``runner.model``) are shared instead of drawn again."""
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    mesh = make_mesh(parallel)
    max_batch = max(batches)
    max_model_len = max_context + steps * scheduler_steps + 16
    config = RunnerConfig(
        model_config=ModelConfig(dtype="bfloat16", max_model_len=max_model_len),
        cache_config=CacheConfig(
            num_gpu_blocks_override=max_batch * (-(-max_model_len // 16)) + 16, cache_dtype=cache_dtype
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_batch,
            async_scheduling=True,
            num_scheduler_steps=scheduler_steps,
        ),
        compilation_config=CompilationConfig(
            token_buckets=sorted(set(batches)), request_buckets=sorted(set(batches)), compiler_options=compiler_options
        ),
        parallel_config=parallel,
        lora_config=lora_config,
    )
    runner = ModelRunner(config, mesh)
    runner.load_model(weights if weights is not None else init_random_model(model, dtype="bfloat16", seed=0, mesh=mesh))
    print(f"weights loaded: {json.dumps(device_memory())}", flush=True)
    runner.initialize_kv_cache()
    print(f"caches allocated: {json.dumps(device_memory())}", flush=True)
    runner.kv_caches = fill_random(runner.kv_caches)
    print(f"caches filled: {json.dumps(device_memory())}", flush=True)
    return runner


def steps_per_round(runner: ModelRunner) -> int:
    """Decode steps each dispatch runs: the runner's ``num_scheduler_steps``."""
    return runner.config.scheduler_config.num_scheduler_steps


def request_contexts(batch: int, context: int, spread: float = 0.0) -> list[int]:
    """The contexts of a case's ``batch`` requests: ``context`` each, or with ``spread`` drawn uniformly from
    ``context * [1 - spread, 1 + spread]`` (as ``jaxrunner bench --range-ratio`` draws lengths), the same
    draw for every call of the case."""
    return spread_lengths(np.random.default_rng([batch, context]), context, spread, batch).tolist()


def add_decoding_requests(
    runner: ModelRunner,
    batch: int,
    context: int,
    steps: int,
    rng,
    tag: str,
    adapters: Sequence[LoRARequest] = (),
    spread: float = 0.0,
) -> tuple[list[str], list[int], AsyncModelRunnerOutput]:
    """Give the runner ``batch`` requests at ``request_contexts(batch, context, spread)`` tokens, with blocks
    for ``steps`` more rounds, and dispatch their first step; returns their ids, their contexts and that
    step's pending output. Request ``i`` runs with ``adapters[i % len(adapters)]`` when there are adapters.

    As after a prefix-cache hit, all but the last prompt token are in the cache.
    """
    contexts = request_contexts(batch, context, spread)
    blocks_per_req = -(-(max(contexts) + steps * steps_per_round(runner) + 1) // runner.block_size)
    pool = rng.permutation(runner.num_blocks)
    ids = [f"{tag}b{batch}c{context}r{i}" for i in range(batch)]
    new_reqs = [
        NewRequestData(
            req_id,
            rng.integers(0, runner.vocab_size, length).tolist(),
            SamplingParams(temperature=0.0),
            (pool[i * blocks_per_req : (i + 1) * blocks_per_req].tolist(),),
            length - 1,
            lora_request=adapters[i % len(adapters)] if adapters else None,
        )
        for i, (req_id, length) in enumerate(zip(ids, contexts, strict=True))
    ]
    runner.execute_model(SchedulerOutput(new_reqs, CachedRequestData(), {r: 1 for r in ids}, batch))
    return ids, contexts, sample_pending(runner)


def sample_pending(runner: ModelRunner) -> AsyncModelRunnerOutput:
    """``sample_tokens`` for the dispatched step: its output, still pending (``build_runner``'s runners are async)."""
    output = runner.sample_tokens(None)
    assert isinstance(output, AsyncModelRunnerOutput), "build_runner's runners schedule asynchronously"
    return output


def decode_step_output(ids: list[str], contexts: list[int], step: int, round_steps: int = 1) -> SchedulerOutput:
    """The scheduler's output for decode round ``step`` after the first step: ``round_steps`` steps of
    one token for every request (of ``contexts`` tokens at the first step)."""
    cached = CachedRequestData(ids, [context + step * round_steps for context in contexts], [None] * len(ids))
    return SchedulerOutput(
        [], cached, {r: round_steps for r in ids}, len(ids) * round_steps, num_decode_steps=round_steps
    )


def finish_decoding_requests(runner: ModelRunner, ids: list[str]) -> None:
    """Free the requests' slots, so that the next measurement starts from an empty runner."""
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids=set(ids)))


def time_decode(
    runner: ModelRunner,
    batch: int,
    context: int,
    steps: int,
    rng,
    pipelined: bool,
    adapters: Sequence[LoRARequest] = (),
    spread: float = 0.0,
) -> list[float]:
    """Seconds per decode step for ``batch`` requests at ``context`` tokens each (or spread about it:
    ``request_contexts``; spread over ``adapters``, if any), over ``steps`` rounds.

    One round at a time (``pipelined`` False): dispatch, then wait for the tokens on
    the host. Pipelined, as the engine runs with async scheduling: round k+1 is
    dispatched before round k's tokens are read, and a round's time is the interval
    between consecutive outputs, over its steps.
    """
    round_steps = steps_per_round(runner)
    tag = f"p{int(pipelined)}"
    ids, contexts, in_flight = add_decoding_requests(runner, batch, context, steps, rng, tag, adapters, spread)
    times = []
    dispatched = in_flight
    last = time.perf_counter()
    for step in range(steps + 1):
        if not pipelined:
            in_flight.get_output()
        if step < steps:
            runner.execute_model(decode_step_output(ids, contexts, step, round_steps))
            dispatched = sample_pending(runner)
        if pipelined:
            in_flight.get_output()
        now = time.perf_counter()
        if step:
            times.append((now - last) / round_steps)
        last, in_flight = now, dispatched
    finish_decoding_requests(runner, ids)
    return times


def median_step(times: list[float], warmup: int = 3) -> float:
    """The median of ``times`` after the first ``warmup`` (all of them when there are no more)."""
    return statistics.median(times[warmup:] or times)


def random_adapters(config: TransformerConfig, count: int, rank: int, directory: str | Path) -> list[LoRARequest]:
    """``count`` random rank-``rank`` adapters on all seven projections of a ``config`` model, in PEFT's
    format under ``directory``, as the requests that name them."""
    paths = [save_random_lora_adapter(Path(directory) / f"adapter{i}", config, rank=rank, seed=i) for i in range(count)]
    return [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(paths)]
