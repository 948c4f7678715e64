"""Where a decode step's fixed cost goes: the host's Python, the launch of the step's kernels, or the device.

The model is Llama-3-8B's structure (32 layers, 32 query / 8 KV heads of 128,
128k vocabulary) with narrow matrices (hidden 512, MLP 1024), so that its
weights take microseconds to read and a decode step's time is what every step
pays whatever the model's width. For each batch it reports, in one process:

- the step time, pipelined and one step at a time (as ``decode_step.py``);
- how long the step's two program calls (forward, sample) take to return, and
  the time per step when steps are dispatched back to back;
- the kernel-launching instructions of both programs' optimized HLO entry
  computations (fusions, custom calls, conditionals, loops); XLA forms its CUDA
  graphs (command buffers) later, from the thunks, so they do not show here;
- a cProfile of the pipelined steps: the functions that took the host's time.

``--variants`` runs the measurement once per named variant (``VARIANTS``: the
PjRt GPU client launching on the calling thread (jaxrunner's default is a
thread of its own, ``compat.prefer_async_gpu_dispatch``), XLA's CUDA graphs on
(jaxrunner turns them off, ``compat.prefer_kernel_launches_to_cuda_graphs``),
CUDA graphs with the conditionals and loops inside them (XLA leaves them out by
default), the reference attention, and a dump of XLA's thunks (with CUDA graphs on), summarized by
kind: ``kCommandBuffer`` is a CUDA graph; a ``kConditional`` or ``kWhile``
outside one makes the host wait for the device), each in a fresh process, and
prints one table. A variant needs about two minutes on the H200 (random init, compiling),
less where the persistent compilation cache already holds its programs:

    python benchmarks/step_overhead.py --out step_overhead.json
    python benchmarks/step_overhead.py --variants default cuda_graphs graph_conditionals --out-dir $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from decode_step import (
    add_decoding_requests,
    build_runner,
    decode_step_output,
    finish_decoding_requests,
    time_decode,
)
from jaxrunner.models import TransformerConfig
from variants import CUDA_GRAPHS, run_variant

NARROW_LLAMA3 = TransformerConfig(
    vocab_size=128256, hidden_size=512, intermediate_size=1024, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
)


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "s64": 8}


def hlo_op_counts(hlo_text: str) -> dict[str, int]:
    """Kernel-launching instructions of the optimized module's entry computation, and the bytes its copies write."""
    entry = hlo_text[hlo_text.index("\nENTRY "):]
    entry = entry[: entry.index("\n}")]
    counts = collections.Counter()
    for line in entry.splitlines():
        # The result type may be a tuple with spaces: "(bf16[..], f32[..]) custom-call(".
        match = re.search(r"=\s*(\(.*?\)|\S+)\s+(fusion|custom-call|call|while|conditional|copy|scatter|all-reduce)\(",
                          line)
        if not match:
            continue
        kind = "command_buffer" if match[2] == "call" and "command_buffer" in line else match[2]
        counts[kind] += 1
        array = re.fullmatch(r"(\w+)\[([\d,]*)\].*", match[1])
        if kind == "copy" and array and array[1] in DTYPE_BYTES:
            counts["copy_bytes"] += DTYPE_BYTES[array[1]] * int(np.prod([int(d) for d in array[2].split(",") if d]))
    return dict(counts)


def thunk_kinds(dump_dir: str) -> dict[str, dict[str, int]]:
    """Per dumped thunk sequence file (after XLA's thunk passes where present), its thunks counted by kind."""
    files = sorted(Path(dump_dir).glob("*thunk_sequence*.txt"))
    after = {f.name.replace("_after_thunk_passes", "") for f in files if "after_thunk_passes" in f.name}
    return {f.name: dict(collections.Counter(re.findall(r"\bk[A-Z][A-Za-z0-9]+\b", f.read_text())))
            for f in files if "after_thunk_passes" in f.name or f.name not in after}


def dispatch_times(runner, batch: int, context: int, calls: int) -> dict[str, float]:
    """Milliseconds for the step's forward call (``execute_model``) and sample call (``sample_tokens``) to
    return, and per step when steps are dispatched back to back: a call that holds the host until the
    device catches up (a host-side conditional or loop) shows as a call as long as the device's work."""
    ids, first = add_decoding_requests(runner, batch, context, calls, np.random.default_rng(1), "d")
    first.get_output()
    forward, sample, outputs = [], [], []
    start = time.perf_counter()
    for step in range(calls):
        begin = time.perf_counter()
        runner.execute_model(decode_step_output(ids, context, step))
        middle = time.perf_counter()
        outputs.append(runner.sample_tokens(None))
        forward.append(middle - begin)
        sample.append(time.perf_counter() - middle)
    for out in outputs:
        out.get_output()
    total = time.perf_counter() - start
    finish_decoding_requests(runner, ids)
    return {"forward_call_ms": statistics.median(forward) * 1e3, "sample_call_ms": statistics.median(sample) * 1e3,
            "back_to_back_ms": total / calls * 1e3}


def profile_steps(runner, batch: int, context: int, steps: int) -> str:
    """The pipelined steps under cProfile: the top functions by their own time."""
    profiler = cProfile.Profile()
    rng = np.random.default_rng(2)
    profiler.enable()
    time_decode(runner, batch, context, steps, rng, True)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


VARIANTS = {
    "default": {},
    "sync_dispatch": {"PJRT_GPU_ENABLE_ASYNC_DISPATCH": "0"},
    "cuda_graphs": {"XLA_FLAGS": CUDA_GRAPHS},
    # As cuda_graphs, with the sample program's lax.cond stages (and the top-k loop) as CUDA graph conditional
    # nodes instead of thunks outside the graph, each of which copies its predicate to the host and waits for it.
    "graph_conditionals": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"},
    "reference_attention": {"JAXRUNNER_ATTENTION_IMPL": "reference"},
    "thunk_dump": {"XLA_FLAGS": f"{CUDA_GRAPHS} --xla_dump_to={{dump}}"},
}
"""Environment overrides of each variant; ``{dump}`` is the variant's dump folder."""


def run_variants(args: argparse.Namespace) -> None:
    """Each variant in a fresh process (the environment is read when the backend starts), then one table."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{'variant':>20} {'batch':>5} {'step':>7} {'1-at-a-time':>11} {'forward call':>12} {'sample call':>11} "
             f"{'back to back':>12}  (ms)"]
    for name in args.variants:
        dump = tempfile.mkdtemp(prefix=f"thunks-{name}-")
        out = out_dir / f"step_overhead_{name}.json"
        command = [sys.executable, __file__, "--batches", *map(str, args.batches), "--context", str(args.context),
                   "--steps", str(args.steps), "--out", str(out)]
        if "{dump}" in "".join(VARIANTS[name].values()):
            command += ["--thunk-dump", dump]
        overrides = {k: v.format(dump=dump) for k, v in VARIANTS[name].items()}
        code = run_variant(command, overrides, args.timeout, out_dir / f"step_overhead_{name}.log")
        if code != 0 or not out.exists():
            lines.append(f"{name:>20} failed ({code}): see step_overhead_{name}.log")
        else:
            lines += [f"{name:>20} {r['batch']:>5} {r['step_ms']:>7.2f} {r['one_at_a_time_ms']:>11.2f} "
                      f"{r['forward_call_ms']:>12.2f} {r['sample_call_ms']:>11.2f} {r['back_to_back_ms']:>12.2f}"
                      for r in json.loads(out.read_text())["rows"]]
        print(f"{name} done", flush=True)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="step_overhead.json")
    parser.add_argument("--thunk-dump", help="the --xla_dump_to folder of this run: summarize its thunk sequences")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="run these variants, one process each")
    parser.add_argument("--out-dir", default="step_overhead", help="with --variants: where each variant's JSON goes")
    parser.add_argument("--timeout", type=float, default=240, help="with --variants: seconds each may run")
    args = parser.parse_args()
    if args.variants:
        run_variants(args)
        return

    runner = build_runner(NARROW_LLAMA3, args.batches, args.context, 2 * args.steps)
    runner.capture_model()
    variant = {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "PJRT_GPU_ENABLE_ASYNC_DISPATCH",
                                                  "JAXRUNNER_ATTENTION_IMPL")}
    rows = []
    for batch in args.batches:
        rng = np.random.default_rng(0)
        row = {"batch": batch, "context": args.context,
               "step_ms": statistics.median(time_decode(runner, batch, args.context, args.steps, rng, True)[3:]) * 1e3,
               "one_at_a_time_ms": statistics.median(
                   time_decode(runner, batch, args.context, args.steps, rng, False)[3:]) * 1e3,
               **dispatch_times(runner, batch, args.context, args.steps),
               "forward_hlo": hlo_op_counts(runner._forward_programs.get(batch).as_text()),
               "sample_hlo": hlo_op_counts(runner._sample_programs.get((batch, True)).as_text()),  # greedy: plain
               "host_profile": profile_steps(runner, batch, args.context, args.steps)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "host_profile"}), flush=True)
        print(row["host_profile"], flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, **variant, "rows": rows}
    if args.thunk_dump:
        result["thunks"] = thunk_kinds(args.thunk_dump)
        if not result["thunks"]:
            print(f"no thunk sequences in {args.thunk_dump}: XLA writes them on GPUs only", flush=True)
        for name, kinds in result["thunks"].items():
            print(name, kinds, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
