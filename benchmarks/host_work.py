"""The engine's host work per step, on the built-in tiny model: many requests decoding at once.

With a tiny model the host's share is what the step is made of, so changes to the
scheduler, the input packing or the output handling show here first. On a CPU the
device work shares the cores with the host thread: compare runs made back to back
on one machine, alternating the versions.

    python benchmarks/host_work.py --requests 64 --output-len 400
"""

from __future__ import annotations

import argparse
import time

from jaxrunner import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=400)
    args = parser.parse_args()
    llm = LLM("tiny-llama", max_num_seqs=args.requests, max_model_len=args.prompt_len + args.output_len + 16)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(args.prompt_len)] for i in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
    engine = llm.llm_engine
    engine.step_times = type(engine.step_times)()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0),
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    times = engine.step_times
    per_step = lambda seconds: seconds / times.num_steps * 1e3  # noqa: E731
    print(f"steps {times.num_steps} wall/step {per_step(elapsed):.2f} ms host {per_step(times.host_s):.2f} "
          f"call {per_step(times.call_s):.2f} wait {per_step(times.wait_s):.2f}")


if __name__ == "__main__":
    main()
