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

With ``--loras N`` every case runs again on a runner with N random adapters of
``--lora-rank`` on all seven projections (PEFT's format, requests spread over
them) beside the same weights: each step's time over the plain runner's is the
cost of LoRA serving.

With ``--shape qwen3-30b-a3b`` (mixture of experts) the floor counts the experts a batch of random
tokens touches (``1 - (1 - top_k / experts) ** batch`` of each layer's, their expected share), and the
roofline each token's ``top_k`` experts' FLOPs; ``$JAXRUNNER_MOE_IMPL`` picks the experts' products
(``models/moe.py``), recorded as ``moe_impl``. With ``--shape gemma3-12b`` a sliding-window layer's
floor counts only the window's keys and values.

With ``--quantization fp8`` the weights are random FP8 (per-channel scales, the matmuls as each bucket
chooses them: ``ops/fp8_matmul.py``) and the floor counts their bytes; ``--kv-cache-dtype fp8`` halves the
KV's.

With ``--shape llama3-8b-narrow`` (the 8B's layers, heads and vocabulary with
narrow matrices) the step's floor is tiny and its time is the fixed cost every
step pays. ``--shape tiny`` runs on a CPU in seconds (the test suite's check).

    python -m benchmarks.decode_step --out decode_step.json
    python -m benchmarks.decode_step --batches 1 16 64 256 --contexts 1024 4096 --out decode_step.json
    python -m benchmarks.decode_step --tensor-parallel-size 2 --profile --out tp2.json
    python -m benchmarks.decode_step --batches 1 64 --contexts 1024 --loras 4 --lora-rank 16 --out lora.json
    python -m benchmarks.decode_step --batches 1 64 --contexts 1024 --quantization fp8 --out fp8.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.device_timeline import (
    GRAPHS_WHILE_PROFILING_FLAG,
    device_events,
    host_events,
    print_summary,
    save_events,
    summarize,
)
from benchmarks.harness import (
    SHAPES,
    build_runner,
    cupti_kernel_timings,
    device_facts,
    device_memory,
    measure_floors,
    median_step,
    random_adapters,
    request_contexts,
    steps_per_round,
    time_decode,
    write_json,
)
from jaxrunner import envs
from jaxrunner.config import CACHE_DTYPES, LoRAConfig
from jaxrunner.models.loader import with_quantization
from jaxrunner.models.moe import moe_impl
from jaxrunner.runner.model_runner import ModelRunner

# Kernel names of an all-reduce: NCCL's (ncclDevKernel_AllReduce_...) and XLA's own.
ALL_REDUCE_KERNEL = re.compile(r"all[-_ ]?reduce", re.IGNORECASE)


def kernel_profile(
    runner: ModelRunner, batch: int, context: int, steps: int, rng, adapters=(), spread: float = 0.0, top: int = 12
) -> dict:
    """CUPTI's record of every kernel in ``steps`` pipelined decode steps (plus the first, which adds
    the requests): kernels and kernel time per step, the ``top`` kernel names by time, and the
    all-reduces' time and share of the kernel time. Under tensor parallelism the figures sum
    every device's kernels.

    Kernel time is the sum of the kernels' durations: were two streams to run kernels at
    once, it would count both, so the step's time outside kernels is a lower bound.
    """
    timings = cupti_kernel_timings(lambda: time_decode(runner, batch, context, steps, rng, True, adapters, spread))
    by_name: dict[str, list[float]] = {}
    for name, ms in timings:
        by_name.setdefault(name, []).append(ms)
    executed = steps * steps_per_round(runner) + 1
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    kernel_ms = sum(ms for _, ms in timings)
    all_reduce_ms = sum(ms for name, ms in timings if ALL_REDUCE_KERNEL.search(name))
    return dict(
        kernels_per_step=len(timings) / executed,
        kernel_ms_per_step=kernel_ms / executed,
        all_reduce_ms_per_step=all_reduce_ms / executed,
        all_reduce_share=all_reduce_ms / kernel_ms if kernel_ms else 0.0,
        top_kernels=[
            dict(name=name[:120], per_step=len(ms) / executed, ms_per_step=sum(ms) / executed) for name, ms in ranked
        ],
    )


def traced_timeline(
    runner: ModelRunner, batch: int, context: int, steps: int, rng, keep: Path | None, adapters=(), spread: float = 0.0
) -> dict:
    """The device timeline of ``steps`` pipelined decode steps (plus the first), from a profiler trace,
    with the host's events during its longest gaps; its events are saved to ``keep`` when given."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            time_decode(runner, batch, context, steps, rng, True, adapters, spread)
        path = next(Path(trace_dir).rglob("*.xplane.pb"), None)
        if path is None:
            return {"error": "the profiler wrote no trace"}
        profile = jax.profiler.ProfileData.from_file(str(path))
    device, host = device_events(profile), host_events(profile)
    if keep is not None:
        save_events(keep, device, host)
    return summarize(device, steps * steps_per_round(runner) + 1, host=host)


def matmul_weights(runner: ModelRunner) -> tuple[int, int, int, int]:
    """(bytes, parameters) of the weight matrices every step multiplies its rows by: all matrices but an
    untied embedding table, of which a step reads only its tokens' rows; then (bytes, parameters) of
    those that are experts (0, 0 for a dense model)."""
    tied = runner.model_arch.tie_word_embeddings
    leaves = jax.tree_util.tree_flatten_with_path(runner.params)[0]
    named = [(jax.tree_util.keystr(path), x) for path, x in leaves if x.ndim >= 2]
    matrices = [x for name, x in named if tied or "embed_tokens" not in name]
    experts = [x for name, x in named if "experts" in name]
    return (
        sum(x.size * x.dtype.itemsize for x in matrices),
        sum(x.size for x in matrices),
        sum(x.size * x.dtype.itemsize for x in experts),
        sum(x.size for x in experts),
    )


def step_bytes_and_flops(runner: ModelRunner, contexts: list[int], weight_bytes: int, matmul) -> dict:
    """What a decode step of requests at ``contexts`` must read and compute: the weights (only the
    experts the batch touches, expected for uniform routing), the matrices' bytes and FLOPs (each token's
    ``top_k`` experts only), and the KV (only a sliding-window layer's window)."""
    arch, batch = runner.model_arch, len(contexts)
    matmul_bytes, matmul_params, expert_bytes, expert_params = matmul
    if arch.moe is not None:
        touched = 1 - (1 - arch.moe.top_k / arch.moe.num_experts) ** batch
        untouched = expert_bytes * (1 - touched)
        weight_bytes, matmul_bytes = weight_bytes - untouched, matmul_bytes - untouched
        matmul_params = matmul_params - expert_params * (1 - arch.moe.top_k / arch.moe.num_experts)
    per_layer_token = runner.kv_cache_spec.bytes_per_block / runner.block_size / arch.num_layers
    windows = [arch.layer_sliding_window(i) for i in range(arch.num_layers)]
    keys = sum(min(context + 1, window or context + 1) for context in contexts for window in windows)
    kv_bytes = keys * per_layer_token
    return dict(
        weight_bytes=weight_bytes, matmul_bytes=matmul_bytes, flops=2 * batch * matmul_params, kv_bytes=kv_bytes
    )


def measure_case(
    runner: ModelRunner,
    batch: int,
    context: int,
    args,
    rng,
    floors: dict,
    weight_bytes: int,
    matmul: tuple[int, int, int, int],
    adapters=(),
) -> dict:
    """One batch x context: step times one round at a time and pipelined, against the bandwidth floor and
    the roofline floor; the kernel profile and device timeline when asked for.

    The bandwidth floor is every weight's and KV byte at the copy rate. The roofline floor counts
    the weight matrices at the slower of their bytes at the copy rate and their FLOPs (2 a row and
    parameter) at the matmul rate: from about 200 rows (the device's FLOPs per byte) bf16 GEMMs are
    compute-bound, a time no kernel removes.
    """
    spread = args.context_spread
    one_at_a_time = median_step(time_decode(runner, batch, context, args.steps, rng, False, adapters, spread))
    step = median_step(time_decode(runner, batch, context, args.steps, rng, True, adapters, spread))
    need = step_bytes_and_flops(runner, request_contexts(batch, context, spread), weight_bytes, matmul)
    # Each of the TP devices reads its share of the weights and KV at the copy rate.
    devices = args.tensor_parallel_size
    floor = (need["weight_bytes"] + need["kv_bytes"]) / (floors["copy_bytes_per_s"] * devices)
    gemms = max(need["matmul_bytes"] / floors["copy_bytes_per_s"], need["flops"] / floors["matmul_flops_per_s"])
    roofline = (gemms + need["kv_bytes"] / floors["copy_bytes_per_s"]) / devices
    row = dict(
        batch=batch,
        context=context,
        context_spread=spread,
        step_ms=step * 1e3,
        floor_ms=floor * 1e3,
        ratio=step / floor,
        roofline_floor_ms=roofline * 1e3,
        roofline_ratio=step / roofline,
        tokens_per_s=batch / step,
        one_at_a_time_ms=one_at_a_time * 1e3,
        memory=device_memory(),
    )
    if args.profile:
        row["profile"] = kernel_profile(runner, batch, context, args.steps, rng, adapters, spread)
    if args.trace:
        keep = Path(args.keep_events) / f"events_b{batch}_c{context}.json.gz" if args.keep_events else None
        row["timeline"] = traced_timeline(runner, batch, context, args.steps, rng, keep, adapters, spread)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument(
        "--context-spread",
        type=float,
        default=0.0,
        help="each request's context drawn uniformly from context * [1 - s, 1 + s] (bench's --range-ratio); "
        "0: every request at the context",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--floor-elements", type=int, default=1 << 30, help="bf16 elements of the copy test (2 GiB)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument(
        "--scheduler-steps",
        type=int,
        default=1,
        help="decode steps per dispatch, in one program (multi-step scheduling)",
    )
    parser.add_argument(
        "--compiler-options",
        type=json.loads,
        default=None,
        help="XLA options for the step programs as JSON ('{}': XLA's defaults; "
        "default: the runner's, by rows: CompilationConfig.step_compiler_options)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many devices (the floor divides by it)",
    )
    parser.add_argument(
        "--loras",
        type=int,
        default=0,
        help="then run every case again on a runner with this many random adapters (requests spread over "
        "them) beside the same weights, and give each step's time over the plain runner's",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="the rank of --loras' adapters (on all projections)")
    parser.add_argument(
        "--quantization", choices=["fp8"], help="the weights in FP8 (random, per-channel scales); unset: bf16"
    )
    parser.add_argument("--kv-cache-dtype", choices=list(CACHE_DTYPES), default="auto", help="the KV cache's dtype")
    parser.add_argument("--out", default="decode_step.json")
    parser.add_argument("--profile", action="store_true", help="also record each case's kernels with CUPTI (GPU)")
    parser.add_argument("--trace", action="store_true", help="also trace each case's device timeline (GPU)")
    parser.add_argument(
        "--keep-events",
        help="with --trace: save each case's device and host events "
        "(a few MB of gzipped JSON; device_timeline.load_events reads them) into this folder",
    )
    args = parser.parse_args()
    if args.keep_events and not args.trace:
        parser.error("--keep-events keeps the events of the traces that --trace records; add --trace")
    if args.keep_events:
        Path(args.keep_events).mkdir(parents=True, exist_ok=True)
    if args.trace:  # before the backend starts: where XLA_FLAGS turns CUDA graphs on, keep them while tracing
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {GRAPHS_WHILE_PROFILING_FLAG}".strip()

    facts = device_facts()
    floors = measure_floors(args.floor_elements)
    start = time.perf_counter()
    runner_for = functools.partial(
        build_runner,
        with_quantization(SHAPES[args.shape], args.quantization),
        args.batches,
        round(max(args.contexts) * (1 + args.context_spread)),
        args.steps,
        args.scheduler_steps,
        args.compiler_options,
        args.tensor_parallel_size,
        cache_dtype=args.kv_cache_dtype,
    )
    runner = runner_for()
    load_s = time.perf_counter() - start
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.params))
    matmul = matmul_weights(runner)
    compile_s = runner.capture_model()
    memory = {"after_precompile": device_memory(), "programs": runner.program_memory_bytes()}
    print(f"after precompile: {json.dumps(memory['after_precompile'])}", flush=True)
    for kind, buckets in memory["programs"].items():
        for bucket, sizes in buckets.items():
            print(f"  {kind} {bucket}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()), flush=True)

    def measure_all(runner: ModelRunner, adapters=()) -> list[dict]:
        rng = np.random.default_rng(0)
        rows = []
        for batch in args.batches:
            for context in args.contexts:
                try:
                    rows.append(measure_case(runner, batch, context, args, rng, floors, weight_bytes, matmul, adapters))
                except Exception as exc:  # out of memory, say: keep the other cases and what was in use
                    rows.append(dict(batch=batch, context=context, error=repr(exc)[:2000], memory=device_memory()))
                    print(f"batch {batch} x {context}: {rows[-1]['error'][:300]}", flush=True)
        return rows

    rows = measure_all(runner)
    lora_rows = []
    if args.loras:
        weights = runner.model
        del runner  # its KV cache and programs; the LoRA runner shares the weights
        runner = runner_for(LoRAConfig(max_loras=args.loras, max_lora_rank=args.lora_rank), weights)
        runner.capture_model()
        with tempfile.TemporaryDirectory() as adapter_dir:
            adapters = random_adapters(runner.model_arch, args.loras, args.lora_rank, adapter_dir)
            lora_rows = measure_all(runner, adapters)
        for row, base in zip(lora_rows, rows, strict=True):
            if "error" not in row and "error" not in base:
                row.update(loras=args.loras, lora_rank=args.lora_rank, lora_over_base=row["step_ms"] / base["step_ms"])
    result = dict(
        **facts,
        shape=args.shape,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        moe_impl=moe_impl(envs.JAXRUNNER_MOE_IMPL),
        scheduler_steps=args.scheduler_steps,
        tensor_parallel_size=args.tensor_parallel_size,
        compiler_options={batch: runner.compilation.compiler_options(batch) for batch in args.batches},
        weight_gb=weight_bytes / 1e9,
        matmul_weight_gb=matmul[0] / 1e9,
        load_s=load_s,
        precompile_s=compile_s,
        programs=runner.num_compiled_programs,
        memory=memory,
        **floors,
        rows=rows,
        lora_rows=lora_rows,
    )
    write_json(args.out, result)
    print(
        f"device {facts['device']}, jax {facts['jax']}, weights {weight_bytes / 1e9:.2f} GB, "
        f"load {load_s:.0f} s, precompile {compile_s:.0f} s ({runner.num_compiled_programs} programs)"
    )
    print(
        f"copy {floors['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {floors['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s "
        f"(one device); tensor parallel size {args.tensor_parallel_size}"
    )
    print(
        f"{'batch':>5} {'context':>7} {'step ms':>8} {'floor ms':>8} {'ratio':>6} {'roofline ms':>11} "
        f"{'ratio':>6} {'tok/s':>8} {'1-at-a-time ms':>14}"
    )
    for r in rows:
        if "error" in r:
            continue
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['step_ms']:>8.2f} {r['floor_ms']:>8.2f} {r['ratio']:>6.2f} "
            f"{r['roofline_floor_ms']:>11.2f} {r['roofline_ratio']:>6.2f} {r['tokens_per_s']:>8.0f} "
            f"{r['one_at_a_time_ms']:>14.2f}"
        )
    for r in lora_rows:
        if "lora_over_base" in r:
            print(
                f"with {r['loras']} adapters of rank {r['lora_rank']}, batch {r['batch']} x {r['context']}: "
                f"{r['step_ms']:.2f} ms a step, {r['lora_over_base']:.3f}x the plain runner's"
            )
    for r in rows + lora_rows:
        if "profile" in r:
            prof = r["profile"]
            print(
                f"batch {r['batch']} x {r['context']}: {prof['kernels_per_step']:.0f} kernels, "
                f"{prof['kernel_ms_per_step']:.2f} ms in kernels of a {r['step_ms']:.2f} ms step "
                f"(TP {args.tensor_parallel_size}: all devices), all-reduces {prof['all_reduce_ms_per_step']:.3f} "
                f"ms ({100 * prof['all_reduce_share']:.1f}% of the kernel time)"
            )
            for k in prof["top_kernels"]:
                print(f"  {k['ms_per_step']:7.3f} ms  x{k['per_step']:<5.0f} {k['name']}")
        if "timeline" in r:
            print_summary(f"batch {r['batch']} x {r['context']} timeline (step {r['step_ms']:.2f} ms)", r["timeline"])


if __name__ == "__main__":
    main()
