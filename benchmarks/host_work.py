"""The engine's host work per step: many requests decoding at once, with where that work goes.

With the built-in tiny model the host's share is what the step is made of, so
changes to the scheduler, the input packing or the output handling show here
first. On a CPU the device work shares the cores with the host thread: compare
runs made back to back on one machine, alternating the versions. On a GPU, with
``--model random-llama3-8b``, it is the bench's workload with the host's work
split by the engine's parts (``--breakdown``: each part's inclusive time per
step, its program calls and waits left out).

    python benchmarks/host_work.py --requests 64 --output-len 400
    python benchmarks/host_work.py --model random-llama3-8b --requests 64 --prompt-len 1000 --output-len 256 \\
        --max-model-len 2048 --token-buckets 64 1024 2048 4096 8192 --request-buckets 16 64 --breakdown
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from jaxrunner import LLM, SamplingParams
from jaxrunner.engine.llm_engine import LLMEngine
from jaxrunner.runner.model_runner import ModelRunner, _PendingOutput
from jaxrunner.engine.scheduler import Scheduler

# The engine's parts whose host time the breakdown reports, by (class, method).
PARTS = [
    (Scheduler, "schedule"),
    (ModelRunner, "execute_model"),
    (ModelRunner, "prepare_inputs"),
    (ModelRunner, "sample_tokens"),
    (_PendingOutput, "__init__"),
    (LLMEngine, "_process"),
    (_PendingOutput, "get_output"),
    (Scheduler, "update_from_output"),
]


class Breakdown:
    """Inclusive wall time of each part, less the time the runner spent in program calls and waits meanwhile."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: type, name: str) -> None:
        method = getattr(owner, name)
        label = f"{owner.__name__}.{name}"
        self.seconds[label] = 0.0
        runner = self.runner

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start, device = time.perf_counter(), runner.program_call_s + runner.device_wait_s
            try:
                return method(*args, **kwargs)
            finally:
                blocked = runner.program_call_s + runner.device_wait_s - device
                self.seconds[label] += time.perf_counter() - start - blocked

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--token-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--request-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true", help="time the engine's parts (a few us of timers a step)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    llm = LLM(
        args.model, max_num_seqs=args.requests, max_num_batched_tokens=max(args.token_buckets or [0]) or None,
        max_model_len=args.max_model_len or args.prompt_len + args.output_len + 16,
        token_buckets=args.token_buckets, request_buckets=args.request_buckets,
        num_scheduler_steps=args.num_scheduler_steps,
    )
    prompts = [[(7 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
    engine = llm.llm_engine
    breakdown = Breakdown(engine.runner)
    if args.breakdown:
        for owner, name in PARTS:
            breakdown.wrap(owner, name)
    engine.step_times = type(engine.step_times)()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0),
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    times = engine.step_times
    per_step = lambda seconds: seconds / times.num_steps * 1e3  # noqa: E731
    result = dict(steps=times.num_steps, wall_ms=per_step(elapsed), host_ms=per_step(times.host_s),
                  call_ms=per_step(times.call_s), wait_ms=per_step(times.wait_s))
    if times.decode_steps:
        result.update(decode_steps=times.decode_steps, decode_step_ms=times.decode_wall_s / times.decode_steps * 1e3,
                      decode_host_ms=times.decode_host_s / times.decode_steps * 1e3)
        result["decode_host_share"] = result["decode_host_ms"] / result["decode_step_ms"]
    if args.breakdown:
        result["parts_ms"] = {label: per_step(s) for label, s in breakdown.seconds.items()}
    print(f"steps {times.num_steps} wall/step {result['wall_ms']:.2f} ms host {result['host_ms']:.2f} "
          f"call {result['call_ms']:.2f} wait {result['wait_ms']:.2f}")
    if times.decode_steps:
        print(f"{times.decode_steps} decode-only steps: {result['decode_step_ms']:.2f} ms each, engine host work "
              f"{result['decode_host_ms']:.2f} ms ({100 * result['decode_host_share']:.1f}%)")
    for label, ms in result.get("parts_ms", {}).items():
        print(f"  {label}: {ms:.3f} ms a step (inclusive)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
