"""HuggingFace transformers on PyTorch: the peer of the end-to-end benchmark (``e2e.py``, part e).

A ``LlamaForCausalLM`` of Llama-3-8B's shape with random bf16 weights, run the
way a research user would run it at its fastest: a static KV cache, the fastest
attention installed (``flash_attention_2`` if the package is there, else
``sdpa``), and the decode forward under ``torch.compile`` with transformers' own
compile config (the one ``generate`` uses on a static cache: inductor,
``reduce-overhead``, CUDA graphs), eager where compiling fails. It measures:

- the decode step at each batch x context: one token per request through the
  forward pass plus the greedy argmax that feeds the next step, the static cache
  first filled by a chunked prefill of random tokens; CUDA events, median of
  ``--steps`` steps after ``--warmup``; the next token stays on the device (no
  host copy), which favours the peer;
- offline throughput: N requests of fixed input/output lengths, C at a time
  (static batching: each batch of C through ``generate`` with
  ``min_new_tokens = max_new_tokens = output length`` and a static cache),
  wall clock from the first batch to the last, after a warm-up ``generate`` of
  each batch shape so that compiling is not timed. ``--max-batches k`` runs only
  the first k batches of C; the JSON then says ``subset: true`` and the
  figure is for the batches run. ``compiled`` there means transformers'
  auto-compile applied (a GPU, a static cache, compiling not disabled).

Dynamo keeps its defaults (automatic dynamic shapes: after a shape changes, one
graph with that dimension dynamic), as a user's would, with a higher recompile
limit so that no case silently falls back to eager.

The model's shape is one of ``benchmarks.harness.SHAPES``, the ones the
jaxrunner side of the comparison runs. On the H200 (alone, about 8 minutes;
``benchmarks.e2e`` runs it as part e with the cases it needs):

    python -m benchmarks.hf_peer --out hf_peer.json

A trial there (torch 2.11, transformers 5.17) took 15 s to start, 30-70 s per
torch.compile, 4.8 s per batch of 256 at 128/128, and 0.159 s per decode step at
batch 256 over a 2000-token cache (so ~165 s for one batch of 256 at 1000/1000).

On a CPU, to check the script in seconds (``--no-compile``: torch.compile's
CUDA-graph config is for GPUs, and compiling for the CPU takes minutes):

    python -m benchmarks.hf_peer --shape tiny --decode 1x64 4x64 --workloads 8x32/16 \\
        --concurrency 4 --steps 5 --warmup 2 --no-compile --out /tmp/hf_peer.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils.import_utils import is_flash_attn_2_available

from benchmarks.harness import SHAPES, commit, parse_pair, parse_workload, write_json

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
# Tokens per prefill forward when filling the cache for a decode measurement: bounds activation memory.
PREFILL_CHUNK_TOKENS = 8192


def build_config(shape: str) -> LlamaConfig:
    """The Llama config of ``shape``: its sizes, Llama 3.1 RoPE scaling, untied embeddings."""
    s = SHAPES[shape]
    return LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=False,
    )


def attention_implementation(requested: str) -> str:
    """``auto``: flash_attention_2 where its package is installed, else PyTorch's sdpa."""
    if requested != "auto":
        return requested
    return "flash_attention_2" if is_flash_attn_2_available() else "sdpa"


def check_random_weights(model: torch.nn.Module) -> None:
    """Refuse weights that are not finite, or matrices that are constant (zeros, uninitialised memory)."""
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise ValueError(f"{name} has non-finite values")
        if param.dim() > 1 and not param.float().std() > 0:
            raise ValueError(f"{name} is constant")


def build_model(shape: str, device: torch.device, attn: str, seed: int) -> LlamaForCausalLM:
    """A random-weight bf16 model built directly on ``device`` (transformers' own init: normal, std 0.02)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(shape), dtype=torch.bfloat16, attn_implementation=attn)
    model.eval()
    check_random_weights(model)
    return model


def cache_argument(model: torch.nn.Module) -> str:
    """The forward's keyword for the KV cache: ``past_key_values`` (transformers 5.17) or ``cache`` (later)."""
    parameters = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in parameters else "cache"


def allow_many_compiles() -> None:
    """Let dynamo keep a graph per shape: past its default recompile limit it would fall back to eager silently."""
    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 256)


def step_seconds(step: Callable[[], None], count: int, device: torch.device) -> list[float]:
    """Seconds of each of ``count`` calls of ``step``: CUDA events on a GPU (no host sync between calls)."""
    if device.type != "cuda":
        times = []
        for _ in range(count):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def random_tokens(model: LlamaForCausalLM, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), device=model.device)


def prefill(model: LlamaForCausalLM, cache, batch: int, context: int) -> None:
    """Fill ``cache`` with ``context`` random tokens per request, in chunks of about PREFILL_CHUNK_TOKENS tokens."""
    chunk = max(1, PREFILL_CHUNK_TOKENS // batch)
    for start in range(0, context, chunk):
        tokens = random_tokens(model, batch, min(chunk, context - start))
        model(input_ids=tokens, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})


def decode_times(
    model: LlamaForCausalLM, forward: Callable, batch: int, context: int, steps: int, warmup: int
) -> list[float]:
    """Seconds per decode step at ``batch`` x ``context``, after ``warmup`` steps, on a freshly prefilled cache."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=context + warmup + steps)
    prefill(model, cache, batch, context)
    tokens = random_tokens(model, batch, 1)
    kwargs = {cache_argument(model): cache, "use_cache": True}

    def step() -> None:
        nonlocal tokens
        torch.compiler.cudagraph_mark_step_begin()
        logits = forward(input_ids=tokens, **kwargs).logits
        tokens = logits[:, -1].argmax(-1, keepdim=True)

    step_seconds(step, warmup, model.device)
    return step_seconds(step, steps, model.device)


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Return cached blocks after a measurement so that the next one has the memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def with_compile_fallback(measure: Callable[[bool], dict], compile: bool, device: torch.device) -> dict:
    """``measure(True)`` (compiled) where asked; if that fails, ``measure(False)`` (eager) with the reason recorded."""
    if compile:
        try:
            return measure(True)
        except Exception as exc:  # a compile failure, most likely: measure eager instead, and say why
            error = repr(exc)[-2000:]
            free_memory(device)
            return measure(False) | {"compiled_run_error": error}
    return measure(False)


def decode_row(model: LlamaForCausalLM, batch: int, context: int, steps: int, warmup: int, compile: bool) -> dict:
    """The median decode step at ``batch`` x ``context``."""

    def measure(compiled: bool) -> dict:
        forward = model.get_compiled_call(CompileConfig()) if compiled else model.__call__
        times = decode_times(model, forward, batch, context, steps, warmup)
        return {
            "step_ms": statistics.median(times) * 1e3,
            "compiled": compiled,
            "peak_memory_gb": peak_memory_gb(model.device),
        }

    return {"batch": batch, "context": context} | with_compile_fallback(measure, compile, model.device)


def batch_sizes(num_requests: int, concurrency: int) -> list[int]:
    """Static batching: full batches of ``concurrency``, then the remainder."""
    sizes = [concurrency] * (num_requests // concurrency)
    return sizes + ([num_requests % concurrency] if num_requests % concurrency else [])


def generate(
    model: LlamaForCausalLM, batch: int, input_len: int, output_len: int, cache_len: int, greedy: bool, compile: bool
) -> int:
    """One ``generate`` of ``batch`` random prompts; returns the number of tokens it generated."""
    prompts = random_tokens(model, batch, input_len)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    # transformers types generate's self as its GenerativePreTrainedModel protocol, which its own models fail
    # (hf_quantizer, encoder, ... undeclared; device a property).
    out = model.generate(  # pyright: ignore[reportAttributeAccessIssue]
        prompts,
        attention_mask=torch.ones_like(prompts),
        min_new_tokens=output_len,
        max_new_tokens=output_len,
        cache_implementation="static",
        max_cache_len=cache_len,
        disable_compile=not compile,
        pad_token_id=0,
        **sampling,
    )
    return out[:, input_len:].numel()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batches(
    model: LlamaForCausalLM, sizes: list[int], input_len: int, output_len: int, greedy: bool, compile: bool
) -> dict:
    """Warm up each batch shape (compile, CUDA graph capture), then time the batches back to back."""
    cache_len = input_len + output_len
    start = time.perf_counter()
    for size in sorted(set(sizes)):
        generate(model, size, input_len, min(4, output_len), cache_len, greedy, compile)
    synchronize(model.device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = sum(generate(model, size, input_len, output_len, cache_len, greedy, compile) for size in sizes)
    synchronize(model.device)
    elapsed = time.perf_counter() - start
    return {
        "warmup_s": warmup_s,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "compiled": compile and model.device.type == "cuda",
    }


def throughput_row(
    model: LlamaForCausalLM,
    workload: tuple[int, int, int],
    concurrency: int,
    max_batches: int,
    greedy: bool,
    compile: bool,
) -> dict:
    """Offline throughput of one workload, on its first ``max_batches`` batches if that is not 0."""
    num_requests, input_len, output_len = workload
    sizes = batch_sizes(num_requests, concurrency)
    run = sizes[:max_batches] if max_batches else sizes

    def measure(compiled: bool) -> dict:
        return time_batches(model, run, input_len, output_len, greedy, compiled) | {
            "peak_memory_gb": peak_memory_gb(model.device)
        }

    return {
        "num_prompts": num_requests,
        "input_len": input_len,
        "output_len": output_len,
        "concurrency": concurrency,
        "batches_total": len(sizes),
        "batches_run": len(run),
        "requests_run": sum(run),
        "subset": len(run) < len(sizes),
        "greedy": greedy,
    } | with_compile_fallback(measure, compile, model.device)


def guarded(measure: Callable[[], dict], device: torch.device, **identity) -> dict:
    """Run one measurement; an error (out of memory, say) is recorded in its row and the next one still runs.

    ``wall_s`` is the whole measurement's time, compiling and prefilling included: for planning runs.
    """
    start = time.perf_counter()
    try:
        row = measure()
    except Exception as exc:
        row = identity | {"error": repr(exc)[-2000:]}
    free_memory(device)
    row["wall_s"] = time.perf_counter() - start
    print(json.dumps(row), flush=True)  # progress, and what a cut-short run measured
    return row


def run(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """Build the model and take every measurement the arguments ask for, saving after each.

    The workloads come first (the figure the comparison is about), then the decode
    cases, so that a run cut short keeps the most important figures.
    """
    device = torch.device(args.device)
    attn = attention_implementation(args.attn)
    allow_many_compiles()
    start = time.perf_counter()
    model = build_model(args.shape, device, attn, args.seed)
    synchronize(device)
    compile = not args.no_compile
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "shape": args.shape,
        "attn_implementation": model.config._attn_implementation,
        "compile_requested": compile,
        "build_s": time.perf_counter() - start,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "throughput": [],
        "decode": [],
    }
    with torch.inference_mode():
        # Shortest sequences first: generate sizes a static cache for the longest it has seen on this model.
        for w in sorted(args.workloads, key=lambda w: w[1] + w[2]):
            measure = functools.partial(
                throughput_row, model, w, args.concurrency, args.max_batches, args.greedy, compile
            )
            result["throughput"].append(guarded(measure, device, num_prompts=w[0], input_len=w[1], output_len=w[2]))
            save(result)
        for b, c in args.decode:
            measure = functools.partial(decode_row, model, b, c, args.steps, args.warmup, compile)
            result["decode"].append(guarded(measure, device, batch=b, context=c))
            save(result)
    return result


def print_table(result: dict) -> None:
    print(
        f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}, "
        f"attention {result['attn_implementation']}, weights {result['weight_bytes'] / 1e9:.2f} GB, "
        f"built in {result['build_s']:.0f} s"
    )
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'compiled':>8}")
    for row in result["decode"]:
        if "error" in row:
            print(f"{row['batch']:>5} {row['context']:>7} error: {row['error'][:80]}")
        else:
            print(f"{row['batch']:>5} {row['context']:>7} {row['step_ms']:>8.2f} {str(row['compiled']):>8}")
    print(f"{'workload':>16} {'requests run':>12} {'out tok/s':>10} {'compiled':>8}")
    for row in result["throughput"]:
        name = f"{row['num_prompts']}x{row['input_len']}/{row['output_len']}"
        if "error" in row:
            print(f"{name:>16} error: {row['error'][:80]}")
        else:
            print(f"{name:>16} {row['requests_run']:>12} {row['output_tokens_per_s']:>10.0f} {str(row['compiled']):>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn", default="auto", help="auto, sdpa, flash_attention_2 or eager")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument(
        "--decode", type=parse_pair, nargs="*", default=[(1, 1024), (64, 4096)], help="decode cases BATCHxCONTEXT"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--workloads",
        type=parse_workload,
        nargs="*",
        default=[(256, 1000, 1000), (1000, 128, 128)],
        help="offline workloads REQUESTSxINPUT/OUTPUT",
    )
    parser.add_argument("--concurrency", type=int, default=256, help="requests per generate call")
    parser.add_argument("--max-batches", type=int, default=0, help="run only the first k batches (0: all)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling at temperature 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="hf_peer.json")
    args = parser.parse_args()
    print_table(run(args, lambda result: write_json(args.out, result)))


if __name__ == "__main__":
    main()
