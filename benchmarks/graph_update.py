"""What a program of many small kernels costs per call, under each way XLA can run its CUDA graph.

A decode step is hundreds of small kernels that XLA records into one CUDA graph
(a command buffer). When an input, output or temporary buffer moves between
calls, XLA updates the graph's nodes before launching it, on the thread that
launches it. This script isolates that cost: a chain of ``--layers`` small
matmul + tanh layers (one or two kernels each), called back to back on fresh
inputs, timed per call (host time of the call, and steady-state time per call
when calls are dispatched back to back) under each variant in ``VARIANTS``,
each in a fresh process (XLA reads its flags once), then one table:

    python benchmarks/graph_update.py --out-dir $OUT

A variant whose flags this XLA does not know fails alone and is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from variants import CUDA_GRAPHS, run_variant

_ASYNC = {"PJRT_GPU_ENABLE_ASYNC_DISPATCH": "1"}
VARIANTS = {
    "sync_dispatch": {"XLA_FLAGS": CUDA_GRAPHS, "PJRT_GPU_ENABLE_ASYNC_DISPATCH": "0"},
    "async_dispatch": {"XLA_FLAGS": CUDA_GRAPHS, **_ASYNC},
    "no_command_buffers": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=", **_ASYNC},
    **{f"update_mode={mode}": {"XLA_FLAGS": f"{CUDA_GRAPHS} --xla_gpu_command_buffer_update_mode={mode}", **_ASYNC}
       for mode in ("NEVER_UPDATE", "CAPTURE_CMD_NEVER_UPDATE", "SKIP_TEMP", "SKIP_PROFILED", "VMM_PERSISTENT_TEMP")},
}
"""Environment of each variant: CUDA graphs launched on the calling thread or PjRt's own, CUDA graphs off, and
XLA's graph update modes (their names differ between XLA versions; a name this XLA lacks fails at start-up)."""


def measure(layers: int, width: int, calls: int) -> dict:
    """Per-call host time and back-to-back time of the layer chain on fresh inputs each call."""
    import jax
    import jax.numpy as jnp

    from step_overhead import hlo_op_counts

    keys = jax.random.split(jax.random.key(0), layers + 1)
    weights = [jax.random.normal(k, (width, width), jnp.bfloat16) / width**0.5 for k in keys[1:]]

    @jax.jit
    def chain(x, weights):
        for w in weights:
            x = jnp.tanh(x @ w)
        return x

    inputs = [jax.random.normal(jax.random.fold_in(keys[0], i), (8, width), jnp.bfloat16) for i in range(calls)]
    compiled = chain.lower(inputs[0], weights).compile()
    for x in inputs[:3]:
        chain(x, weights).block_until_ready()
    host, outputs = [], []
    start = time.perf_counter()
    for x in inputs:
        begin = time.perf_counter()
        outputs.append(chain(x, weights))
        host.append(time.perf_counter() - begin)
    jax.block_until_ready(outputs)
    back_to_back = (time.perf_counter() - start) / calls
    one_at_a_time = []
    for x in inputs[:20]:
        begin = time.perf_counter()
        chain(x, weights).block_until_ready()
        one_at_a_time.append(time.perf_counter() - begin)
    return {"layers": layers, "hlo": hlo_op_counts(compiled.as_text()),
            "call_host_ms": statistics.median(host) * 1e3, "back_to_back_ms": back_to_back * 1e3,
            "one_at_a_time_ms": statistics.median(one_at_a_time) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out-dir", default="graph_update")
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--worker", help="measure in this process and write the result to this JSON file")
    args = parser.parse_args()
    if args.worker:
        Path(args.worker).write_text(json.dumps(measure(args.layers, args.width, args.calls)))
        return
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="graph_update-"))  # per-variant files, kept out of --out-dir
    results = {}
    for name in args.variants:
        out, log = work_dir / f"{name}.json", work_dir / f"{name}.log"
        command = [sys.executable, __file__, "--worker", str(out), "--layers", str(args.layers),
                   "--width", str(args.width), "--calls", str(args.calls)]
        code = run_variant(command, VARIANTS[name], args.timeout, log)
        if code == 0 and out.exists():
            results[name] = json.loads(out.read_text())
        else:
            lines = log.read_text().strip().splitlines()
            results[name] = {"error": f"{code}: " + (lines[-1][:300] if lines else "no output")}
        (out_dir / "graph_update.json").write_text(json.dumps(results, indent=1))
    print(f"{'variant':>34} {'call (host)':>11} {'back to back':>12} {'one at a time':>13}  (ms per call)")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:>34} {r['error']}")
        else:
            print(f"{name:>34} {r['call_host_ms']:>11.3f} {r['back_to_back_ms']:>12.3f} {r['one_at_a_time_ms']:>13.3f}")
    print("kernels:", next((r["hlo"] for r in results.values() if "hlo" in r), None))


if __name__ == "__main__":
    main()
