"""A decode step's matmuls (Llama-3-8B shapes) against the copy floor, per way of running them.

At decode a projection reads its whole weight for a handful of rows, so its floor
is the weight's bytes (plus the activations') over the copy bandwidth measured in
the same run. Each way is timed by CUPTI (the kernels' own durations, the
reduction of a split included), cycling over enough copies of the weight that
no call finds it in L2; at prefill sizes the matmul rate is the floor that counts:

- ``xla``: the model's own expression, as XLA compiles it (its GEMM autotuner);
- ``cublas``: the same program compiled with ``xla_gpu_enable_triton_gemm=False``;
- ``split_k=S``: the contraction cut into ``S`` slices, each a GEMM into float32
  partials summed after (``S`` times the thread blocks for a weight of few columns).

Off a GPU there is no CUPTI: each call is timed by the wall clock instead
(``timer`` in each row says which), and ``--projections`` and ``--scale``
shrink the shapes so that the script runs on a CPU in seconds (the test
suite's check).

    python -m benchmarks.matmul_step --rows 1 64 --out matmul_step.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import cupti_kernel_timings, device_facts, has_cupti, measure_floors, ms_by_kernel, write_json

# (name, contraction size, output size): the 8B layer's four projections and the lm_head.
PROJECTIONS = [
    ("qkv", 4096, 6144),
    ("o", 4096, 4096),
    ("gate_up", 4096, 28672),
    ("down", 14336, 4096),
    ("lm_head", 4096, 128256),
]
L2_BYTES = 50 << 20  # H100's and H200's L2: each call's weight must come from memory


def plain(x, w):
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def split_k(slices: int):
    def run(x, w):
        k = x.shape[1]
        xs = x.reshape(x.shape[0], slices, k // slices)
        ws = w.reshape(slices, k // slices, w.shape[1])
        partial = jnp.einsum("msk,skn->smn", xs, ws, preferred_element_type=jnp.float32)
        return partial.sum(axis=0).astype(x.dtype)

    return run


def variants(split_ks: list[int]) -> dict:
    """name -> (function, compiler options)."""
    out = {"xla": (plain, None), "cublas": (plain, {"xla_gpu_enable_triton_gemm": False})}
    for s in split_ks:
        out[f"split_k={s}"] = (split_k(s), None)
    return out


def time_variant(fn, options, x, weights, repeats: int) -> dict:
    """Seconds per call (all kernels of the call), over ``repeats`` passes over the weights: the kernels'
    own time from CUPTI on a GPU, the wall time of the passes elsewhere."""
    compiled = jax.jit(fn).lower(x, weights[0]).compile(compiler_options=options)
    expected = np.asarray(plain(x, weights[0]), np.float32)
    got = np.asarray(compiled(x, weights[0]), np.float32)
    error = float(np.max(np.abs(got - expected)) / (np.max(np.abs(expected)) + 1e-6))
    for w in weights:  # warm up
        compiled(x, w).block_until_ready()

    def passes():
        for _ in range(repeats):
            for w in weights:
                compiled(x, w)
        jax.block_until_ready(compiled(x, weights[0]))

    calls = repeats * len(weights) + 1
    if not has_cupti():
        start = time.perf_counter()
        passes()
        return dict(kernel_s=(time.perf_counter() - start) / calls, timer="wall", max_rel_error=error)
    timings = cupti_kernel_timings(passes)
    per_kernel = ms_by_kernel(timings)
    top = max(per_kernel, key=lambda name: per_kernel[name])
    return dict(
        kernel_s=sum(per_kernel.values()) / 1e3 / calls,
        kernels_per_call=len(timings) / calls,
        top_kernel=top[:100],
        timer="cupti",
        max_rel_error=error,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--split-k", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--projections",
        nargs="+",
        choices=[name for name, _, _ in PROJECTIONS],
        default=[name for name, _, _ in PROJECTIONS],
    )
    parser.add_argument("--scale", type=int, default=1, help="divide every projection's sizes by this (toy runs)")
    parser.add_argument("--floor-elements", type=int, default=1 << 30, help="bf16 elements of the copy test (2 GiB)")
    parser.add_argument("--out", default="matmul_step.json")
    args = parser.parse_args()
    projections = [(name, k // args.scale, n // args.scale) for name, k, n in PROJECTIONS if name in args.projections]
    facts = device_facts()
    floors = measure_floors(args.floor_elements)
    copy = floors["copy_bytes_per_s"]
    key = jax.random.key(0)
    rows = []
    for name, k, n in projections:
        weight_bytes = k * n * 2
        # Enough copies that no call finds its weight in L2 (on a GPU; timings elsewhere are only a check).
        copies = max(2, -(-2 * L2_BYTES // weight_bytes)) if has_cupti() else 2
        weights = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02 for i in range(copies)]
        for m in args.rows:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.bfloat16)
            floor = (weight_bytes + 2 * m * (k + n)) / copy
            for variant, (fn, options) in variants([s for s in args.split_k if k % s == 0]).items():
                start = time.perf_counter()
                row: dict[str, Any]
                try:
                    row = time_variant(fn, options, x, weights, args.repeats)
                except Exception as exc:  # an option this XLA lacks, say: keep the other variants
                    row = dict(error=repr(exc)[:500])
                row.update(
                    projection=name,
                    rows=m,
                    variant=variant,
                    floor_s=floor,
                    seconds_to_measure=time.perf_counter() - start,
                )
                if "kernel_s" in row:
                    row["fraction_of_copy"] = floor / row["kernel_s"]
                    row["fraction_of_matmul"] = 2 * m * k * n / floors["matmul_flops_per_s"] / row["kernel_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del weights
    result = dict(**facts, **floors, rows=rows)
    write_json(args.out, result)
    print(
        f"\n{result['device']}, copy {copy / 1e12:.2f} TB/s, matmul {floors['matmul_flops_per_s'] / 1e12:.0f} "
        "TFLOP/s; kernel time per call (us) / fraction of the copy floor / fraction of the matmul rate"
    )
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print("projection rows floor_us " + " ".join(names))
    for name, _, _ in projections:
        for m in args.rows:
            cells = [r for r in rows if r["projection"] == name and r["rows"] == m]
            text = [
                f"{r['kernel_s'] * 1e6:.1f}/{r['fraction_of_copy']:.2f}/{r['fraction_of_matmul']:.2f}"
                if "kernel_s" in r
                else "error"
                for r in cells
            ]
            print(f"{name} {m} {cells[0]['floor_s'] * 1e6:.1f} " + " ".join(text))


if __name__ == "__main__":
    main()
