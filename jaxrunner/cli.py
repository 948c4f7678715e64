"""The ``jaxrunner`` command line: ``generate``, ``bench`` and ``serve``.

A user's error (a bad flag, an unknown model, a checkpoint that cannot be read)
is one line on stderr and exit status 2; ``--debug`` shows its traceback. The
flags are checked, and the sampling parameters built, before the model loads.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrunner import envs
from jaxrunner.config import CACHE_DTYPES, user_cache_dir
from jaxrunner.engine import llm as engine_llm
from jaxrunner.interfaces import SamplingParams
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models.builtin import BUILTIN_MODELS, check_model_name, is_builtin
from jaxrunner.models.loader import QUANTIZATION_NAMES

if TYPE_CHECKING:
    from jaxrunner.engine.llm_engine import LLMEngine

USER_ERRORS = (ValueError, OSError, NotImplementedError)
"""Errors reported as one line (exit status 2) unless ``--debug``: bad input, files that cannot be read,
features not supported yet. Anything else is a bug and keeps its traceback."""

DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is"]
_LLM_DEFAULTS = {name: p.default for name, p in inspect.signature(engine_llm.LLM).parameters.items()}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where it is unset (None): the help says what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class _ArgumentParser(argparse.ArgumentParser):
    """Reports a bad flag as one line on stderr, exit status 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _json_object(text: str) -> dict:
    """``--compiler-options``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{}}'; got {text!r}")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    """``--lora``: an adapter as ``NAME=PATH``."""
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(
            f"must be NAME=PATH (a PEFT adapter directory), e.g. sql=/adapters/sql; got {text!r}"
        )
    return name, path


def command_cache_dir() -> str:
    """The command's persistent compilation cache: ``JAXRUNNER_COMPILATION_CACHE_DIR`` when set; none ("")
    when the user configured JAX's own cache (it then holds jaxrunner's programs); else ``user_cache_dir()``.
    The command's process runs only jaxrunner's programs, so the cache is on by default here."""
    chosen = envs.JAXRUNNER_COMPILATION_CACHE_DIR
    if chosen is not None:
        return chosen
    return "" if jax_cache_dir() else user_cache_dir()


def jax_cache_dir() -> str | None:
    """The directory of JAX's persistent compilation cache as configured now (None: none)."""
    import jax

    # JAX defines its options' attributes at run time, out of a type checker's sight.
    return jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]


# LLM's keyword -> the flag's argparse settings (the default is LLM's own).
_ENGINE_FLAGS: dict[str, dict[str, Any]] = {
    "dtype": dict(
        choices=["auto", "bfloat16", "float16", "float32"],
        help="the weights' and activations' dtype; auto: the checkpoint's (float32 for tiny-llama)",
    ),
    "max_model_len": dict(type=int, help="the longest prompt plus output, in tokens; unset: the model's positions"),
    "max_num_seqs": dict(type=int, help="the most requests in one step; unset: 8 on a CPU, 1024 on a GPU"),
    "max_num_batched_tokens": dict(type=int, help="the most tokens in one step; unset: 128 on a CPU, 8192 on a GPU"),
    "block_size": dict(type=int, help="tokens per KV cache block"),
    "gpu_memory_utilization": dict(type=float, help="the fraction of each GPU's memory the engine may use"),
    "kv_cache_dtype": dict(choices=list(CACHE_DTYPES), help="the KV cache's dtype; auto: the model's"),
    "quantization": dict(
        choices=list(QUANTIZATION_NAMES),
        help="fp8: the decoder's weights in FP8, quantized as they load where the checkpoint's are not; "
        "unset: as the checkpoint has them",
    ),
    "num_gpu_blocks_override": dict(
        type=int, help="KV cache blocks to allocate; unset: as many as the memory budget allows"
    ),
    "num_scheduler_steps": dict(type=int, help="decode steps per round, in one device program (1: off)"),
    "tensor_parallel_size": dict(type=int, help="devices that share one copy of the model"),
    "data_parallel_size": dict(type=int, help="independent engine replicas, requests spread across them"),
    "seed": dict(type=int, help="the seed of the built-in models' random weights and of unseeded requests"),
    "token_buckets": dict(
        type=int, nargs="+", help="token counts compiled for, ahead of time; unset: a ladder up to the step's most"
    ),
    "request_buckets": dict(
        type=int, nargs="+", help="request counts compiled for, ahead of time; unset: a ladder up to the step's most"
    ),
    "compiler_options": dict(
        type=_json_object,
        help="XLA options for every step program as JSON, e.g. '{\"xla_gpu_enable_triton_gemm\": true}'; "
        "'{}' for XLA's defaults; unset: cuBLAS for the matmuls of large steps",
    ),
    "compile_threads": dict(type=int, help="programs XLA compiles at once while precompiling (default 1)"),
    "enable_lora": dict(action="store_true", help="serve LoRA adapters (--lora)"),
    "max_loras": dict(type=int, help="LoRA adapters one step may mix (their device slots)"),
    "max_lora_rank": dict(type=int, help="the largest rank a LoRA adapter may have"),
    "max_cpu_loras": dict(type=int, help="LoRA adapters kept read in host memory; unset: --max-loras"),
    "disable_hybrid_kv_cache_manager": dict(
        action="store_true",
        help="full-length KV caches for sliding-window layers too (one KV-cache group), not only their window",
    ),
}


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help=f"a local Hugging Face checkpoint directory, or a built-in model with random weights "
        f"({', '.join(BUILTIN_MODELS)}); nothing is downloaded",
    )
    for name, settings in _ENGINE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), default=_LLM_DEFAULTS[name], **settings)
    parser.add_argument(
        "--compilation-cache-dir",
        default=command_cache_dir(),
        help=f"JAX's persistent compilation cache ('': none); {envs.COMPILATION_CACHE_DIR_ENV_VAR} sets the default",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="process each step's tokens before scheduling the next"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="turn on n-gram speculative decoding with this many drafts per step; unset: off",
    )
    parser.add_argument(
        "--speculative-method",
        choices=("ngram", "ngram_gpu"),
        default="ngram",
        help="vLLM's n-gram proposers: 'ngram' proposes on the host (one step at a time), "
        "'ngram_gpu' on the device (steps overlap under async scheduling)",
    )
    parser.add_argument(
        "--lora",
        type=_lora_module,
        action="append",
        metavar="NAME=PATH",
        help="a LoRA adapter (PEFT's format) the requests run with, in turn; repeat for several (needs --enable-lora)",
    )
    parser.add_argument("--debug", action="store_true", help="show an error's traceback, not only its message")


def _make_llm(args: argparse.Namespace) -> engine_llm.LLM:
    """The engine the flags describe; the model name is checked first, before anything loads."""
    check_model_name(args.model)
    kwargs = {name: getattr(args, name) for name in _ENGINE_FLAGS}
    if args.num_speculative_tokens is not None:
        kwargs["speculative_config"] = {
            "method": args.speculative_method,
            "num_speculative_tokens": args.num_speculative_tokens,
        }
    return engine_llm.LLM(
        args.model,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        compilation_cache_dir=args.compilation_cache_dir,
        **kwargs,
    )


def _lora_requests(args: argparse.Namespace) -> list[LoRARequest]:
    """The ``--lora`` adapters, ids 1, 2, ... in order; refuses a name given twice, or adapters without
    ``--enable-lora`` (as vLLM's), before the model loads."""
    modules = args.lora or []
    if modules and not args.enable_lora:
        raise ValueError("--lora needs --enable-lora.")
    names = [name for name, _ in modules]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"--lora names {repeated} more than once; give each adapter its own name.")
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules)]


def _check_loras(llm: engine_llm.LLM, loras: list[LoRARequest]) -> None:
    """Every ``--lora`` adapter read and checked by every replica before any request runs: a bad one
    fails the command, naming it, rather than refusing its requests."""
    for lora in loras:
        for engine in llm.replicas.engines:
            engine.add_lora(lora)


def _spread(loras: list[LoRARequest], num_requests: int) -> list[LoRARequest | None] | None:
    """Request i's adapter: the ``--lora`` adapters in turn (None: every request runs the base model)."""
    return [loras[i % len(loras)] for i in range(num_requests)] if loras else None


def _model_line(model: str) -> str:
    """What the model is, so that random text is not mistaken for a broken engine."""
    if is_builtin(model):
        return (
            f"model: {model}, built in, with RANDOM weights: its output is random bytes, not language. "
            "Run a real model with --model /path/to/checkpoint (a local Hugging Face checkpoint directory)."
        )
    return f"model: {model}"


def _generate(args: argparse.Namespace) -> None:
    params = SamplingParams(  # refused here, before the model loads
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    loras = _lora_requests(args)
    llm = _make_llm(args)
    _check_loras(llm, loras)
    print(_model_line(args.model))
    prompts = args.prompt or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=_spread(loras, len(prompts)))
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for output in outputs:
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        if output.error:
            print(f"{output.prompt!r} refused: {output.error}")
            continue
        adapter = f" [LoRA {output.lora_request.lora_name}]" if output.lora_request else ""
        print(f"{output.prompt!r}{adapter} -> {completion.text!r} ({completion.finish_reason})")
        print(f"    prompt token ids: {output.prompt_token_ids}")
        print(f"    output token ids: {completion.token_ids}")
    print(f"{num_tokens} output tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s")


def spread_lengths(rng: np.random.Generator, mean: int, spread: float, count: int) -> np.ndarray:
    """Lengths uniform in ``mean * [1 - spread, 1 + spread]`` (``spread`` 0: all equal)."""
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.integers(low, high + 1, count)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"p{p}": float(np.percentile(values, p)) * 1e3 for p in (50, 90, 99)} | {
        "mean": float(np.mean(values)) * 1e3
    }


def _bounds_s(engines: list[LLMEngine], copy_bytes_per_s: float, matmul_flops_per_s: float) -> tuple[float, float]:
    """Seconds the engines' steps take at least, on one device's share: (1) every forward pass reads every
    weight and every scheduled request's KV tokens at the copy rate (``StepTimes``); (2) the roofline: each
    step the slower of those bytes at the copy rate and its FLOPs at the matmul rate (``roofline.step_floor_s``),
    which a step of many prompt tokens is bound by. Data-parallel replicas run side by side: the one that
    takes longest bounds the run."""
    from jaxrunner.roofline import step_costs, step_floor_s

    reads, rooflines = [], []
    for engine in engines:
        costs, times = step_costs(engine.runner), engine.step_times
        reads.append(times.forward_passes * costs.weight_bytes + times.kv_tokens_read * costs.kv_bytes_per_token)
        rooflines.append(sum(step_floor_s(w, costs, copy_bytes_per_s, matmul_flops_per_s) for w in times.work or ()))
    return max(reads) / copy_bytes_per_s, max(rooflines)


def _check_workload(args: argparse.Namespace) -> None:
    """Refuses a workload that cannot run, naming the flag; builds one request's sampling parameters."""
    for flag in ("num_prompts", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1; got {getattr(args, flag)}.")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1); got {args.range_ratio}.")
    SamplingParams(temperature=0.0 if args.greedy else 1.0, max_tokens=args.output_len, ignore_eos=True)


def _bench(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    from jaxrunner.engine.kv_cache_manager import PrefixCacheStats
    from jaxrunner.roofline import copy_bytes_per_s, matmul_flops_per_s

    _check_workload(args)  # before the model loads
    loras = _lora_requests(args)
    llm = _make_llm(args)
    _check_loras(llm, loras)
    # The rates that bound the run, measured before it on what the KV cache leaves free (256 MiB copied and
    # a 4096-wide product on a GPU; token sizes on a CPU, whose figures only show the arithmetic). A model
    # of FP8 weights is bounded at the FP8 matmul rate, the faster one its products may run at.
    gpu = jax.default_backend() == "gpu"
    copy_rate = copy_bytes_per_s(1 << 27 if gpu else 1 << 16)
    fp8_weights = llm.llm_engine.runner.model_arch.quantization is not None
    matmul_rate = matmul_flops_per_s(4096 if gpu else 64, jnp.float8_e4m3fn if fp8_weights else jnp.bfloat16)
    for engine in llm.replicas.engines:
        engine.step_times.work = []
    rng = np.random.default_rng(args.workload_seed)
    vocab = llm.llm_engine.runner.vocab_size
    input_lens = spread_lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    output_lens = spread_lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    if args.repetitive:  # a short random phrase repeated: what prompt lookup can exploit
        prompts = [np.resize(rng.integers(0, vocab, 16), n).tolist() for n in input_lens]
    else:
        prompts = [rng.integers(0, vocab, n).tolist() for n in input_lens]
    params = [
        SamplingParams(temperature=0.0 if args.greedy else 1.0, max_tokens=int(n), ignore_eos=True) for n in output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet, lora_request=_spread(loras, len(prompts)))
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
        "lora_adapters": [lora.lora_name for lora in loras],
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "num_preemptions": sum(e.scheduler.num_preemptions for e in engines),
        "prefix_cache_hit_rate": prefix_cache.hit_rate,
        "kv_cache_blocks": sum(m.num_usable_blocks for m in managers),
        "kv_cache_tokens": sum(m.num_usable_blocks // m.num_groups * m.block_size for m in managers),
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
    bound_s, roofline_s = _bounds_s(engines, copy_rate, matmul_rate)
    result["copy_bytes_per_s"] = copy_rate
    result["matmul_flops_per_s"] = matmul_rate
    for name, seconds in (("bound", bound_s), ("roofline_bound", roofline_s)):
        result[f"{name}_s"] = seconds
        result[f"{name}_output_tokens_per_s"] = num_output / seconds
        result[f"{name}_fraction"] = result["output_tokens_per_s"] / result[f"{name}_output_tokens_per_s"]
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
        f"{result['bound_fraction']:.1%} of it; with each step's FLOPs at {matmul_rate / 1e12:.0f} TFLOP/s "
        f"(the roofline) {roofline_s:.2f} s, {result['roofline_bound_output_tokens_per_s']:.1f} output tok/s, "
        f"{result['roofline_bound_fraction']:.1%}"
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


def _serve(args: argparse.Namespace) -> None:
    try:
        from jaxrunner.entrypoints.openai_server import serve
    except ImportError as error:
        raise ValueError(f"serve needs the serve extra: pip install 'jaxrunner[serve]' ({error}).") from None

    args.model = args.model_tag or args.model
    loras = _lora_requests(args)

    def make_llm() -> engine_llm.LLM:
        llm = _make_llm(args)
        _check_loras(llm, loras)
        print(_model_line(args.model), flush=True)
        return llm

    serve(make_llm, args.served_model_name or args.model, loras, args.host, args.port, args.api_key)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the jaxrunner parser with its generate, bench and serve commands."""
    parser = _ArgumentParser(prog="jaxrunner", description="vLLM's model runner and engine in JAX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    generate = commands.add_parser(
        "generate",
        help="generate text for prompts",
        description="Generate text for prompts; print each output's token ids and text, and the throughput.",
        formatter_class=_HelpFormatter,
    )
    _add_engine_flags(generate)
    generate.add_argument(
        "--prompt",
        action="append",
        help=f"a prompt; repeat for several; unset: {' and '.join(map(repr, DEFAULT_PROMPTS))}",
    )
    generate.add_argument("--max-tokens", type=int, default=32, help="the most tokens generated per prompt")
    generate.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (1: off)")
    generate.add_argument("--top-k", type=int, default=0, help="sample among this many most likely tokens (0: off)")
    generate.add_argument("--sampling-seed", type=int, help="the requests' sampling seed; unset: the engine's")
    generate.set_defaults(run=_generate)

    bench = commands.add_parser(
        "bench",
        help="offline throughput on a synthetic workload",
        description="Offline throughput on random prompts, as vLLM's `bench throughput`.",
        formatter_class=_HelpFormatter,
    )
    _add_engine_flags(bench)
    bench.add_argument("--num-prompts", type=int, default=100, help="requests in the workload")
    bench.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (mean)")
    bench.add_argument("--output-len", type=int, default=128, help="output tokens per request (mean)")
    bench.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    bench.add_argument("--greedy", action="store_true", help="greedy sampling instead of temperature 1")
    bench.add_argument("--repetitive", action="store_true", help="prompts repeat a 16-token phrase")
    bench.add_argument("--workload-seed", type=int, default=0, help="the seed of the prompts and lengths")
    bench.add_argument("--output-json", help="write the results to this JSON file; unset: print only")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(run=_bench)

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve the model over HTTP with OpenAI's API, as `vllm serve`: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics. --lora adapters are served as model names.",
        formatter_class=_HelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model (which it overrides)")
    _add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--api-key", help="the key /v1 requests must give as 'Authorization: Bearer KEY'; unset: none")
    serve.add_argument("--served-model-name", help="the model's name in the API; unset: MODEL")
    serve.set_defaults(run=_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (the process's arguments when None) and run the command; a user's error exits
    with status 2 and one line on stderr (its traceback with ``--debug``)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except USER_ERRORS as error:
        if args.debug:
            raise
        message = str(error).replace("\n", " ")
        print(f"jaxrunner {args.command}: error: {message} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
