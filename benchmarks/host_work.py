"""The engine's host work per step: many requests decoding at once, and with ``--breakdown`` where it goes.

With the built-in tiny model the host's share is what the step is made of, so
changes to the scheduler, the input packing or the output handling show here
first. On a CPU the device work shares the cores with the host thread: compare
runs made back to back on one machine, alternating the versions. On a GPU, with
``--model random-llama3-8b``, it is the bench's workload at batch 64.

``--breakdown`` reads the engine's named spans (``llm.llm_engine.spans``, each
span's own seconds, the spans opened inside it left out) over the timed
generate: the host seconds per step of each span, and apart from them the two
that are not host work, ``program_call`` (the calls into the compiled programs)
and ``device_wait`` (blocking for the sampled tokens).

    python -m benchmarks.host_work --requests 64 --output-len 400
    python -m benchmarks.host_work --model random-llama3-8b --requests 64 --prompt-len 1000 --output-len 256 \\
        --max-model-len 2048 --token-buckets 64 1024 2048 4096 8192 --request-buckets 16 64 --breakdown
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import device_facts, write_json
from jaxrunner import LLM, SamplingParams

# Spans that block on the device rather than do host work.
DEVICE_SPANS = ("program_call", "device_wait")


def breakdown(seconds: dict[str, float], counts: dict[str, int], steps: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per span: milliseconds per engine step and entries per step, host spans first, largest first."""
    per_step = {
        name: {"ms_per_step": s / steps * 1e3, "entries_per_step": counts.get(name, 0) / steps}
        for name, s in sorted(seconds.items(), key=lambda item: -item[1])
    }
    return {
        "host": {k: v for k, v in per_step.items() if k not in DEVICE_SPANS},
        "device": {k: v for k, v in per_step.items() if k in DEVICE_SPANS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--token-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--request-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true", help="report the host seconds per step of each span")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(args.token_buckets or [0]) or None,
        max_model_len=args.max_model_len or args.prompt_len + args.output_len + 16,
        token_buckets=args.token_buckets,
        request_buckets=args.request_buckets,
        num_scheduler_steps=args.num_scheduler_steps,
    )
    prompts = [[(7 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
    engine = llm.llm_engine
    engine.step_times = type(engine.step_times)()
    engine.spans.reset()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0), use_tqdm=False)
    elapsed = time.perf_counter() - start
    times = engine.step_times
    per_step = lambda seconds: seconds / times.num_steps * 1e3
    result = dict(
        **device_facts(),
        model=args.model,
        requests=args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        steps=times.num_steps,
        wall_ms=per_step(elapsed),
        host_ms=per_step(times.host_s),
        call_ms=per_step(times.call_s),
        wait_ms=per_step(times.wait_s),
    )
    if times.decode_steps:
        result.update(
            decode_steps=times.decode_steps,
            decode_step_ms=times.decode_wall_s / times.decode_steps * 1e3,
            decode_host_ms=times.decode_host_s / times.decode_steps * 1e3,
        )
        result["decode_host_share"] = result["decode_host_ms"] / result["decode_step_ms"]
    if args.breakdown:
        result["spans"] = breakdown(engine.spans.seconds, engine.spans.counts, times.num_steps)
    print(
        f"steps {times.num_steps} wall/step {result['wall_ms']:.2f} ms host {result['host_ms']:.2f} "
        f"call {result['call_ms']:.2f} wait {result['wait_ms']:.2f}"
    )
    if times.decode_steps:
        print(
            f"{times.decode_steps} decode-only steps: {result['decode_step_ms']:.2f} ms each, engine host work "
            f"{result['decode_host_ms']:.2f} ms ({100 * result['decode_host_share']:.1f}%)"
        )
    for kind, spans in result.get("spans", {}).items():
        for name, span in spans.items():
            print(f"  {kind} {name}: {span['ms_per_step']:.3f} ms a step ({span['entries_per_step']:.2f} entries)")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
