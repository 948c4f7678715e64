"""Decode step time of a Llama-3-8B-shaped model against its bandwidth floor.

Measures, in one run: the copy bandwidth and bf16 matmul rate of the device
(the floors), then the runner's full decode step (execute_model + sample_tokens,
host work included) at each batch x context, with random bf16 weights and a
randomly filled KV cache: pipelined as under async scheduling (the step time),
and one step at a time (dispatch, wait for the tokens). The floor of a step is
the bytes it must read, the weights plus every request's KV, over the measured
copy bandwidth. With ``--profile`` (GPU only), CUPTI also records every kernel
of a further pipelined run at each case: the device time a step spends inside
kernels against its wall time (the rest is the device waiting between
kernels), and the kernels that take the most of it. With ``--trace`` (GPU
only), a ``jax.profiler`` trace of a further run at each case gives the
device's whole timeline (``device_timeline.py``): copies and memsets too, and
the idle time split into its gaps, the longest named by their neighbours.
With ``--scheduler-steps K`` each dispatch is a round of K decode steps in one
program (multi-step scheduling), and every time is per decode step. With
``--tensor-parallel-size N`` the model and its KV cache are split over N
devices, each reading 1/N of the bytes: the floor is the bytes over N copy
rates, and the profile reports the all-reduces' share of the kernel time.

    python benchmarks/decode_step.py --out results.json
    python benchmarks/decode_step.py --tensor-parallel-size 2 --profile --out tp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.models.builtin import BUILTIN_MODELS
from jaxrunner.config import CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
from jaxrunner.interfaces import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.models import TransformerConfig, init_random_model
from jaxrunner.sharding import make_mesh
from device_timeline import (
    GRAPHS_WHILE_PROFILING_FLAG,
    device_events,
    host_events,
    print_summary,
    save_events,
    summarize,
)

# A few-layer stand-in to check the script itself on a CPU.
TINY = TransformerConfig(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=8192,
)
SHAPES = {"llama3-8b": BUILTIN_MODELS["random-llama3-8b"], "llama3-70b": BUILTIN_MODELS["random-llama3-70b"], "tiny": TINY}
# Kernel names of an all-reduce: NCCL's (ncclDevKernel_AllReduce_...) and XLA's own.
ALL_REDUCE_KERNEL = re.compile(r"all[-_ ]?reduce", re.IGNORECASE)


def median_seconds(fn, repeats: int) -> float:
    fn().block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_floors(elements: int) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, on random data.

    The copy is JAX's jitted ``x * 2`` and, where torch has CUDA, torch's
    device-to-device copy of as many bytes; the faster one is the floor.
    """
    key = jax.random.key(0)
    x = jax.random.normal(key, (elements,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2)
    t_copy = median_seconds(lambda: double(x), 20)
    del x
    n = 8192 if elements >= 1 << 28 else 1024
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda p, q: p @ q)
    t_mm = median_seconds(lambda: matmul(a, b), 10)
    floors = {"jax_copy_bytes_per_s": 2 * 2 * elements / t_copy, "matmul_flops_per_s": 2 * n**3 / t_mm}
    floors.update(torch_copy_bytes_per_s(elements))
    floors["copy_bytes_per_s"] = max(v for k, v in floors.items() if k.endswith("copy_bytes_per_s"))
    return floors


def torch_copy_bytes_per_s(elements: int) -> dict[str, float | str]:
    """torch's device-to-device copy rate of ``elements`` bf16 values (read + written), or why there is none."""
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
            make = jax.jit(lambda k: jax.random.normal(k, shape, dtype), out_shardings=sharding)
            filled.append(make(jax.random.fold_in(key, 2 * i + j)))
        out.append(tuple(filled))
    return out


def device_memory() -> dict[str, int]:
    """Bytes in use on the device (and the peak and limit where the backend reports them), and the
    bytes of the arrays Python still holds: a gap between the two is temporaries or leaked buffers."""
    stats = jax.devices()[0].memory_stats() or {}
    held = {"live_array_bytes": sum(a.nbytes for a in jax.live_arrays())}
    return held | {k: int(v) for k, v in stats.items() if k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def steps_per_round(runner: ModelRunner) -> int:
    """Decode steps each dispatch runs: the runner's ``num_scheduler_steps``."""
    return runner.config.scheduler_config.num_scheduler_steps


def add_decoding_requests(runner: ModelRunner, batch: int, context: int, steps: int, rng, tag: str):
    """Give the runner ``batch`` requests at ``context`` tokens, with blocks for ``steps`` more rounds,
    and dispatch their first step; returns their ids and that step's pending output.

    As after a prefix-cache hit, all but the last prompt token are in the cache.
    """
    blocks_per_req = -(-(context + steps * steps_per_round(runner) + 1) // runner.block_size)
    pool = rng.permutation(runner.num_blocks)
    ids = [f"{tag}b{batch}c{context}r{i}" for i in range(batch)]
    new_reqs = [
        NewRequestData(req_id, rng.integers(0, runner.vocab_size, context).tolist(), SamplingParams(temperature=0.0),
                       (pool[i * blocks_per_req : (i + 1) * blocks_per_req].tolist(),), context - 1)
        for i, req_id in enumerate(ids)
    ]
    runner.execute_model(SchedulerOutput(new_reqs, CachedRequestData(), {r: 1 for r in ids}, batch))
    return ids, runner.sample_tokens(None)


def decode_step_output(ids: list[str], context: int, step: int, round_steps: int = 1) -> SchedulerOutput:
    """The scheduler's output for decode round ``step`` after the first step: ``round_steps`` steps of
    one token for every request."""
    cached = CachedRequestData(ids, [context + step * round_steps] * len(ids), [None] * len(ids))
    return SchedulerOutput([], cached, {r: round_steps for r in ids}, len(ids) * round_steps,
                           num_decode_steps=round_steps)


def finish_decoding_requests(runner: ModelRunner, ids: list[str]) -> None:
    """Free the requests' slots, so that the next measurement starts from an empty runner."""
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids=set(ids)))


def time_decode(runner: ModelRunner, batch: int, context: int, steps: int, rng, pipelined: bool) -> list[float]:
    """Seconds per decode step for ``batch`` requests at ``context`` tokens each, over ``steps`` rounds.

    One round at a time (``pipelined`` False): dispatch, then wait for the tokens on
    the host. Pipelined, as the engine runs with async scheduling: round k+1 is
    dispatched before round k's tokens are read, and a round's time is the interval
    between consecutive outputs, over its steps.
    """
    round_steps = steps_per_round(runner)
    ids, in_flight = add_decoding_requests(runner, batch, context, steps, rng, f"p{int(pipelined)}")
    times = []
    last = time.perf_counter()
    for step in range(steps + 1):
        if not pipelined:
            in_flight.get_output()
        if step < steps:
            runner.execute_model(decode_step_output(ids, context, step, round_steps))
            dispatched = runner.sample_tokens(None)
        if pipelined:
            in_flight.get_output()
        now = time.perf_counter()
        if step:
            times.append((now - last) / round_steps)
        last, in_flight = now, dispatched
    finish_decoding_requests(runner, ids)
    return times


def cupti_kernel_timings(run: Callable[[], object]) -> list[tuple[str, float]]:
    """(kernel name, milliseconds) of every kernel the GPU ran during ``run()``, from CUPTI's
    activity API, as Mosaic GPU's own profiler reads it."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        run()
    finally:
        timings = ext._cupti_get_timings(True)
    return timings


def kernel_profile(runner: ModelRunner, batch: int, context: int, steps: int, rng, top: int = 12) -> dict:
    """CUPTI's record of every kernel in ``steps`` pipelined decode steps (plus the first, which adds
    the requests): kernels and kernel time per step, the ``top`` kernel names by time, and the
    all-reduces' time and share of the kernel time. Under tensor parallelism the figures sum
    every device's kernels.

    Kernel time is the sum of the kernels' durations: were two streams to run kernels at
    once, it would count both, so the step's time outside kernels is a lower bound.
    """
    timings = cupti_kernel_timings(lambda: time_decode(runner, batch, context, steps, rng, True))
    by_name: dict[str, list[float]] = {}
    for name, ms in timings:
        by_name.setdefault(name, []).append(ms)
    executed = steps * steps_per_round(runner) + 1
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    kernel_ms = sum(ms for _, ms in timings)
    all_reduce_ms = sum(ms for name, ms in timings if ALL_REDUCE_KERNEL.search(name))
    return dict(kernels_per_step=len(timings) / executed,
                kernel_ms_per_step=kernel_ms / executed,
                all_reduce_ms_per_step=all_reduce_ms / executed,
                all_reduce_share=all_reduce_ms / kernel_ms if kernel_ms else 0.0,
                top_kernels=[dict(name=name[:120], per_step=len(ms) / executed, ms_per_step=sum(ms) / executed)
                             for name, ms in ranked])


def traced_timeline(runner: ModelRunner, batch: int, context: int, steps: int, rng, keep: Path | None) -> dict:
    """The device timeline of ``steps`` pipelined decode steps (plus the first), from a profiler trace,
    with the host's events during its longest gaps; its events are saved to ``keep`` when given."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            time_decode(runner, batch, context, steps, rng, True)
        path = next(Path(trace_dir).rglob("*.xplane.pb"), None)
        if path is None:
            return {"error": "the profiler wrote no trace"}
        profile = jax.profiler.ProfileData.from_file(str(path))
    device, host = device_events(profile), host_events(profile)
    if keep is not None:
        save_events(keep, device, host)
    return summarize(device, steps * steps_per_round(runner) + 1, host=host)


def build_runner(
    model: TransformerConfig, batches: list[int], max_context: int, steps: int, scheduler_steps: int = 1,
    compiler_options: dict | None = None, tensor_parallel_size: int = 1,
) -> ModelRunner:
    """A runner on a random-weight ``model``, buckets exactly ``batches``, a random KV cache,
    ``scheduler_steps`` decode steps per round, its programs compiled with ``compiler_options``
    (None: the runner's defaults), the model split over ``tensor_parallel_size`` devices."""
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    mesh = make_mesh(parallel)
    max_batch = max(batches)
    max_model_len = max_context + steps * scheduler_steps + 16
    config = RunnerConfig(
        model_config=ModelConfig(dtype="bfloat16", max_model_len=max_model_len),
        cache_config=CacheConfig(num_gpu_blocks_override=max_batch * (-(-max_model_len // 16)) + 16),
        scheduler_config=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_batch,
                                         async_scheduling=True, num_scheduler_steps=scheduler_steps),
        compilation_config=CompilationConfig(token_buckets=sorted(set(batches)),
                                             request_buckets=sorted(set(batches)),
                                             compiler_options=compiler_options),
        parallel_config=parallel,
    )
    runner = ModelRunner(config, mesh)
    runner.load_model(init_random_model(model, dtype="bfloat16", seed=0, mesh=mesh))
    print(f"weights loaded: {json.dumps(device_memory())}", flush=True)
    runner.initialize_kv_cache()
    print(f"caches allocated: {json.dumps(device_memory())}", flush=True)
    runner.kv_caches = fill_random(runner.kv_caches)
    print(f"caches filled: {json.dumps(device_memory())}", flush=True)
    return runner


def measure_case(runner: ModelRunner, batch: int, context: int, args, rng, floors: dict, weight_bytes: int) -> dict:
    """One batch x context: step times one round at a time and pipelined, against the bandwidth floor;
    the kernel profile and device timeline when asked for."""
    one_at_a_time = statistics.median(time_decode(runner, batch, context, args.steps, rng, False)[3:])
    step = statistics.median(time_decode(runner, batch, context, args.steps, rng, True)[3:])
    kv_bytes = batch * (context + 1) * runner.kv_cache_spec.bytes_per_block / runner.block_size
    # Each of the TP devices reads its share of the weights and KV at the copy rate.
    floor = (weight_bytes + kv_bytes) / (floors["copy_bytes_per_s"] * args.tensor_parallel_size)
    row = dict(batch=batch, context=context, step_ms=step * 1e3, floor_ms=floor * 1e3, ratio=step / floor,
               tokens_per_s=batch / step, one_at_a_time_ms=one_at_a_time * 1e3, memory=device_memory())
    if args.profile:
        row["profile"] = kernel_profile(runner, batch, context, args.steps, rng)
    if args.trace:
        keep = Path(args.keep_events) / f"events_b{batch}_c{context}.json.gz" if args.keep_events else None
        row["timeline"] = traced_timeline(runner, batch, context, args.steps, rng, keep)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--floor-elements", type=int, default=1 << 30, help="bf16 elements of the copy test (2 GiB)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--scheduler-steps", type=int, default=1,
                        help="decode steps per dispatch, in one program (multi-step scheduling)")
    parser.add_argument("--compiler-options", type=json.loads, default=None,
                        help="XLA options for the step programs as JSON ('{}': XLA's defaults; "
                        "default: the runner's, by rows: CompilationConfig.step_compiler_options)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over this many devices (the floor divides by it)")
    parser.add_argument("--out", default="decode_step.json")
    parser.add_argument("--profile", action="store_true", help="also record each case's kernels with CUPTI (GPU)")
    parser.add_argument("--trace", action="store_true", help="also trace each case's device timeline (GPU)")
    parser.add_argument("--keep-events", help="with --trace: save each case's device and host events "
                        "(a few MB of gzipped JSON; device_timeline.load_events reads them) into this folder")
    args = parser.parse_args()
    if args.keep_events and not args.trace:
        parser.error("--keep-events keeps the events of the traces that --trace records; add --trace")
    if args.keep_events:
        Path(args.keep_events).mkdir(parents=True, exist_ok=True)
    if args.trace:  # before the backend starts: where XLA_FLAGS turns CUDA graphs on, keep them while tracing
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {GRAPHS_WHILE_PROFILING_FLAG}".strip()

    device = jax.devices()[0]
    floors = measure_floors(args.floor_elements)
    start = time.perf_counter()
    runner = build_runner(SHAPES[args.shape], args.batches, max(args.contexts), args.steps, args.scheduler_steps,
                          args.compiler_options, args.tensor_parallel_size)
    load_s = time.perf_counter() - start
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.params))
    compile_s = runner.capture_model()
    memory = {"after_precompile": device_memory(), "programs": runner.program_memory_bytes()}
    print(f"after precompile: {json.dumps(memory['after_precompile'])}", flush=True)
    for kind, buckets in memory["programs"].items():
        for bucket, sizes in buckets.items():
            print(f"  {kind} {bucket}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()), flush=True)

    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            try:
                rows.append(measure_case(runner, batch, context, args, rng, floors, weight_bytes))
            except Exception as exc:  # out of memory, say: keep the other cases and what was in use
                rows.append(dict(batch=batch, context=context, error=repr(exc)[:2000], memory=device_memory()))
                print(f"batch {batch} x {context}: {rows[-1]['error'][:300]}", flush=True)
    result = dict(device=device.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                  scheduler_steps=args.scheduler_steps, tensor_parallel_size=args.tensor_parallel_size,
                  compiler_options={batch: runner.compiler_options(batch) for batch in args.batches},
                  weight_gb=weight_bytes / 1e9, load_s=load_s, precompile_s=compile_s,
                  programs=runner.num_compiled_programs, memory=memory, **floors, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"device {device.device_kind}, jax {jax.__version__}, weights {weight_bytes / 1e9:.2f} GB, "
          f"load {load_s:.0f} s, precompile {compile_s:.0f} s ({runner.num_compiled_programs} programs)")
    print(f"copy {floors['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {floors['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s "
          f"(one device); tensor parallel size {args.tensor_parallel_size}")
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'floor ms':>8} {'ratio':>6} {'tok/s':>8} {'1-at-a-time ms':>14}")
    for r in rows:
        if "error" in r:
            continue
        print(f"{r['batch']:>5} {r['context']:>7} {r['step_ms']:>8.2f} {r['floor_ms']:>8.2f} "
              f"{r['ratio']:>6.2f} {r['tokens_per_s']:>8.0f} {r['one_at_a_time_ms']:>14.2f}")
    for r in rows:
        if "profile" in r:
            prof = r["profile"]
            print(f"batch {r['batch']} x {r['context']}: {prof['kernels_per_step']:.0f} kernels, "
                  f"{prof['kernel_ms_per_step']:.2f} ms in kernels of a {r['step_ms']:.2f} ms step "
                  f"(TP {args.tensor_parallel_size}: all devices), all-reduces {prof['all_reduce_ms_per_step']:.3f} "
                  f"ms ({100 * prof['all_reduce_share']:.1f}% of the kernel time)")
            for k in prof["top_kernels"]:
                print(f"  {k['ms_per_step']:7.3f} ms  x{k['per_step']:<5.0f} {k['name']}")
        if "timeline" in r:
            print_summary(f"batch {r['batch']} x {r['context']} timeline (step {r['step_ms']:.2f} ms)", r["timeline"])


if __name__ == "__main__":
    main()
