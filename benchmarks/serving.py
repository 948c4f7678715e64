"""Serving benchmark: many HTTP clients streaming from ``jaxrunner serve``, against the offline engine.

Starts ``jaxrunner serve`` with the given engine flags (or uses ``--url``), sends
``--num-prompts`` random token-id prompts of ``--input-len`` tokens (drawn as
``jaxrunner bench`` draws its own: the same lengths, other ids), each asking for
``--output-len`` tokens (``ignore_eos``), from at most ``--max-concurrency`` streaming
clients at once (optionally arriving at ``--request-rate`` a second, Poisson), and
reports output tok/s with time to first token, time per output token and
inter-token latency percentiles, as vLLM's serving benchmark does. With
``--offline`` it then runs ``jaxrunner bench`` on the same workload and engine flags
and reports the server's throughput over the offline engine's.

    python -m benchmarks.serving --model random-llama3-8b --num-prompts 1000 --input-len 1000 \\
        --output-len 1000 --max-concurrency 256 --offline \\
        --engine-args "--max-model-len 2048 --max-num-seqs 256"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from benchmarks.harness import device_facts, write_json

SERVED_NAME = "bench"
STARTUP_TIMEOUT_S = 1800


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen | None, timeout_s: float) -> None:
    """Polls ``/health`` until the server answers 200 (the model is loaded and compiled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"jaxrunner serve exited with status {server.returncode} before it was ready")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1.0)
    raise TimeoutError(f"{url} was not healthy within {timeout_s:.0f} s")


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """The prompts: random token ids, the same for a seed (as ``jaxrunner bench``'s without --range-ratio)."""
    rng = np.random.default_rng(args.workload_seed)
    return [rng.integers(0, vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]


async def one_request(client, prompt: list[int], args: argparse.Namespace) -> dict:
    """Streams one completion; the arrival time of each chunk that carries tokens."""
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    stream = await client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=args.output_len,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        tokens = len(getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else 0
        if tokens:
            arrivals.append((time.perf_counter(), tokens))
    if not arrivals:
        raise RuntimeError("a request streamed no tokens")
    times = [start] + [t for t, _ in arrivals]
    num_tokens = sum(n for _, n in arrivals)
    end = arrivals[-1][0]
    return {
        "ttft_s": arrivals[0][0] - start,
        "tpot_s": (end - arrivals[0][0]) / (num_tokens - 1) if num_tokens > 1 else None,
        "itl_s": list(np.diff(times[1:])),
        "output_tokens": num_tokens,
    }


async def run_clients(url: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[dict], float]:
    """Every prompt through at most ``max_concurrency`` clients at once; the results and the wall time."""
    import openai

    # The client's own connection pool holds 1,000 connections: more than any concurrency here.
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=None, max_retries=0)
    gate = asyncio.Semaphore(args.max_concurrency)
    rng = np.random.default_rng(args.workload_seed + 1)

    async def limited(prompt: list[int], delay: float) -> dict:
        await asyncio.sleep(delay)
        async with gate:
            return await one_request(client, prompt, args)

    gaps = rng.exponential(1.0 / args.request_rate, len(prompts)) if args.request_rate else np.zeros(len(prompts))
    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p, d) for p, d in zip(prompts, np.cumsum(gaps))))
    elapsed = time.perf_counter() - start
    await client.close()
    return list(results), elapsed


def percentiles_ms(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {f"p{p}": float(np.percentile(values, p)) * 1e3 for p in (50, 90, 99)} | {
        "mean": float(np.mean(values)) * 1e3
    }


def offline_bench(args: argparse.Namespace) -> dict:
    """``jaxrunner bench`` on the same workload and engine flags, in a process of its own."""
    out = f"{args.out}.offline.json"
    command = [
        sys.executable,
        "-m",
        "jaxrunner",
        "bench",
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--workload-seed",
        str(args.workload_seed),
        "--quiet",
        "--output-json",
        out,
        *shlex.split(args.engine_args),
    ]
    subprocess.run(command, check=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="what jaxrunner serve serves (unless --url)")
    parser.add_argument("--engine-args", default="", help="engine flags for jaxrunner serve (and bench), quoted")
    parser.add_argument("--url", help="a running server (its model served as 'bench') instead of starting one")
    parser.add_argument("--vocab-size", type=int, help="with --url: the vocabulary prompts are drawn from")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--request-rate", type=float, help="requests a second, Poisson arrivals (default: all at once)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--offline", action="store_true", help="also run jaxrunner bench on the same workload")
    parser.add_argument("--out", default="serving.json")
    args = parser.parse_args()

    server = None
    url = args.url
    if url is None:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "jaxrunner",
            "serve",
            args.model,
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
        ]
        server = subprocess.Popen([*command, *shlex.split(args.engine_args)])
        url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server, STARTUP_TIMEOUT_S)
        vocab_size = args.vocab_size or vocab_of(args.model)
        results, elapsed = asyncio.run(run_clients(url, workload(args, vocab_size), args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    output_tokens = sum(r["output_tokens"] for r in results)
    row = {
        **device_facts(),
        "args": vars(args),
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "requests_per_s": len(results) / elapsed,
        "ttft_ms": percentiles_ms([r["ttft_s"] for r in results]),
        "tpot_ms": percentiles_ms([r["tpot_s"] for r in results]),
        "itl_ms": percentiles_ms([gap for r in results for gap in r["itl_s"]]),
    }
    print(
        f"served {len(results)} requests in {elapsed:.1f} s: {row['output_tokens_per_s']:.1f} output tok/s; "
        + "; ".join(
            f"{name} " + ", ".join(f"{k} {v:.1f}" for k, v in row[name].items())
            for name in ("ttft_ms", "tpot_ms", "itl_ms")
        )
    )
    if args.offline:
        offline = offline_bench(args)
        row["offline"] = offline
        row["served_over_offline"] = row["output_tokens_per_s"] / offline["output_tokens_per_s"]
        print(
            f"offline: {offline['output_tokens_per_s']:.1f} output tok/s; served / offline "
            f"{row['served_over_offline']:.3f}"
        )
    write_json(args.out, row)


def vocab_of(model: str) -> int:
    """The vocabulary of a built-in model or a checkpoint's ``config.json``."""
    from jaxrunner.models.builtin import BUILTIN_MODELS, is_builtin

    if is_builtin(model):
        return BUILTIN_MODELS[model].vocab_size
    with open(f"{model}/config.json") as f:
        return json.load(f)["vocab_size"]


if __name__ == "__main__":
    main()
