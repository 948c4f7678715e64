"""The ``jaxrunner`` command line: ``generate`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxrunner.engine.llm_engine import LLMEngine

_ENGINE_FLAGS = {
    "dtype": str,
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "gpu_memory_utilization": float,
    "kv_cache_dtype": str,
    "num_gpu_blocks_override": int,
    "seed": int,
    "tensor_parallel_size": int,
    "data_parallel_size": int,
    "num_scheduler_steps": int,
}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama", help="a HuggingFace checkpoint directory or a built-in name")
    for name, kind in _ENGINE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="process each step's tokens before scheduling the next"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="turn on n-gram speculative decoding with this many drafts per step",
    )
    parser.add_argument("--token-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--request-buckets", type=int, nargs="+", default=None)
    parser.add_argument(
        "--compiler-options",
        type=json.loads,
        default=None,
        help="XLA options for every step program as JSON, e.g. "
        "'{\"xla_gpu_enable_triton_gemm\": true}'; '{}' for XLA's defaults",
    )


def _make_llm(args: argparse.Namespace):
    from jaxrunner.engine.llm import LLM

    names = [*_ENGINE_FLAGS, "token_buckets", "request_buckets", "compiler_options"]
    kwargs = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.num_speculative_tokens:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    return LLM(
        args.model,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        **kwargs,
    )


def _generate(args: argparse.Namespace) -> None:
    from jaxrunner.interfaces import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for output in outputs:
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        if output.error:
            print(f"error: {output.error}")
        else:
            print(f"{output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    print(f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s")


def _lengths(rng: np.random.Generator, mean: int, spread: float, count: int) -> np.ndarray:
    """Lengths uniform in ``mean * [1 - spread, 1 + spread]`` (``spread`` 0: all equal)."""
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.integers(low, high + 1, count)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"p{p}": float(np.percentile(values, p)) * 1e3 for p in (50, 90, 99)} | {
        "mean": float(np.mean(values)) * 1e3
    }


def _read_bound_s(engines: list[LLMEngine], copy_bytes_per_s: float) -> float:
    """Seconds the engines' steps take at least: each forward pass reads every weight and every
    scheduled request's KV tokens (``StepTimes``), one device's share at its copy rate.
    Data-parallel replicas run side by side: the one that read most bounds the run."""
    from jaxrunner.roofline import bytes_on_device
    from jaxrunner.sharding import tensor_parallel_size

    bounds = []
    for engine in engines:
        runner, times = engine.runner, engine.step_times
        weight_bytes = bytes_on_device(runner.params, runner.mesh.local_devices[0])
        kv_spec = runner.kv_cache_spec.per_device(tensor_parallel_size(runner.mesh))
        kv_bytes = times.kv_tokens_read * kv_spec.bytes_per_block / kv_spec.block_size
        bounds.append((times.forward_passes * weight_bytes + kv_bytes) / copy_bytes_per_s)
    return max(bounds)


def _bench(args: argparse.Namespace) -> None:
    import jax

    from jaxrunner.engine.kv_cache_manager import PrefixCacheStats
    from jaxrunner.interfaces import SamplingParams
    from jaxrunner.roofline import copy_bytes_per_s

    llm = _make_llm(args)
    # The copy rate that bounds the run, measured before it on what the KV cache leaves free
    # (256 MiB copied on a GPU; a token size on a CPU, whose figure only shows the arithmetic).
    copy_rate = copy_bytes_per_s(1 << 27 if jax.default_backend() == "gpu" else 1 << 16)
    rng = np.random.default_rng(args.workload_seed)
    vocab = llm.llm_engine.runner.vocab_size
    input_lens = _lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    output_lens = _lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    if args.repetitive:  # a short random phrase repeated: what prompt lookup can exploit
        prompts = [np.resize(rng.integers(0, vocab, 16), n).tolist() for n in input_lens]
    else:
        prompts = [rng.integers(0, vocab, n).tolist() for n in input_lens]
    params = [
        SamplingParams(temperature=0.0 if args.greedy else 1.0, max_tokens=int(n), ignore_eos=True) for n in output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_input = int(input_lens.sum())
    ttft = [o.metrics.time_to_first_token for o in outputs if o.metrics and o.metrics.time_to_first_token]
    tpot = [o.metrics.time_per_output_token for o in outputs if o.metrics and o.metrics.time_per_output_token]
    engines = llm.replicas.engines  # data-parallel replicas: their counts add up
    managers = [e.scheduler.kv_cache_manager for e in engines]
    prefix_cache = PrefixCacheStats(
        queries=sum(m.stats.queries for m in managers), hits=sum(m.stats.hits for m in managers)
    )
    step_times = [e.step_times for e in engines]
    steps = max(sum(t.num_steps for t in step_times), 1)
    result = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "num_preemptions": sum(e.scheduler.num_preemptions for e in engines),
        "prefix_cache_hit_rate": prefix_cache.hit_rate,
        "kv_cache_blocks": sum(m.num_usable_blocks for m in managers),
        "kv_cache_tokens": sum(m.num_usable_blocks * m.block_size for m in managers),
        "max_num_scheduled_reqs": max(e.scheduler.max_num_scheduled_reqs for e in engines),
        "num_steps": sum(t.num_steps for t in step_times),
        "host_ms_per_step": sum(t.host_s for t in step_times) / steps * 1e3,
        "program_call_ms_per_step": sum(t.call_s for t in step_times) / steps * 1e3,
        "device_wait_ms_per_step": sum(t.wait_s for t in step_times) / steps * 1e3,
    }
    decode_steps = sum(t.decode_steps for t in step_times)
    if decode_steps:
        decode_wall = sum(t.decode_wall_s for t in step_times)
        result["decode_steps"] = decode_steps
        result["decode_step_ms"] = decode_wall / decode_steps * 1e3
        result["decode_host_ms_per_step"] = sum(t.decode_host_s for t in step_times) / decode_steps * 1e3
        result["decode_host_share"] = result["decode_host_ms_per_step"] / result["decode_step_ms"]
    bound_s = _read_bound_s(engines, copy_rate)
    result["copy_bytes_per_s"] = copy_rate
    result["bound_s"] = bound_s
    result["bound_output_tokens_per_s"] = num_output / bound_s
    result["bound_fraction"] = result["output_tokens_per_s"] / result["bound_output_tokens_per_s"]
    budget = llm.llm_engine.runner.memory_budget  # replicas alike
    assert budget is not None  # the cache is allocated
    result["memory_budget"] = budget.summary()
    spec = sum((e.scheduler.spec_stats for e in engines[1:]), engines[0].scheduler.spec_stats)
    if spec.num_steps:
        result["mean_accepted_length"] = spec.mean_accepted_length
        result["acceptance_rate_per_position"] = spec.acceptance_rate_per_position
        print(
            f"speculative: mean accepted length {spec.mean_accepted_length:.2f}, per position "
            + ", ".join(f"{r:.2f}" for r in spec.acceptance_rate_per_position)
        )
    print(
        f"{len(outputs)} requests in {elapsed:.1f} s: {result['requests_per_s']:.2f} req/s, "
        f"{result['output_tokens_per_s']:.1f} output tok/s, {result['total_tokens_per_s']:.1f} total tok/s"
    )
    print(
        f"KV cache: {result['kv_cache_blocks']} blocks for requests (block 0 pads), "
        f"{result['kv_cache_tokens']} tokens; at most {result['max_num_scheduled_reqs']} requests in one step"
    )
    print(f"memory: {budget}")
    print(
        f"bound: reading the weights and KV tokens of every step at {copy_rate / 1e12:.3f} TB/s takes "
        f"{bound_s:.2f} s, {result['bound_output_tokens_per_s']:.1f} output tok/s; this run reached "
        f"{result['bound_fraction']:.1%} of it"
    )
    print(
        f"{result['num_steps']} steps: engine host work {result['host_ms_per_step']:.2f} ms, program calls "
        f"{result['program_call_ms_per_step']:.2f} ms, waiting for tokens {result['device_wait_ms_per_step']:.2f} ms "
        "a step"
    )
    if decode_steps:
        print(
            f"{decode_steps} decode-only steps: {result['decode_step_ms']:.2f} ms each, engine host work "
            f"{result['decode_host_ms_per_step']:.2f} ms ({result['decode_host_share']:.1%} of the step)"
        )
    for name in ("ttft_ms", "tpot_ms"):
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in result[name].items()))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (the process's arguments when None) and run the command."""
    parser = argparse.ArgumentParser(prog="jaxrunner", description="vLLM's model runner and engine in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for prompts")
    _add_engine_flags(generate)
    generate.add_argument("--prompt", action="append", default=None, help="repeat for several prompts")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.set_defaults(run=_generate)

    bench = commands.add_parser("bench", help="offline throughput on a synthetic workload")
    _add_engine_flags(bench)
    bench.add_argument("--num-prompts", type=int, default=100)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    bench.add_argument("--greedy", action="store_true")
    bench.add_argument("--repetitive", action="store_true", help="prompts repeat a 16-token phrase")
    bench.add_argument("--workload-seed", type=int, default=0)
    bench.add_argument("--output-json", default=None)
    bench.add_argument("--quiet", action="store_true")
    bench.set_defaults(run=_bench)

    args = parser.parse_args(argv)
    if args.command == "generate" and not args.prompt:
        args.prompt = ["Hello, my name is", "The capital of France is"]
    args.run(args)
