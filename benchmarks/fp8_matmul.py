"""FP8-weight matmuls (Llama-3-8B shapes) against the copy and FP8 matmul floors, per implementation.

Each projection's weight is random bf16 quantized per output channel
(``ops/fp8_matmul.py``: ``[out, in]`` e4m3 and float32 scales), and each way of
multiplying ``rows`` activations by it is timed by CUPTI (the kernels' own
durations), cycling over enough copies of the weight that no call finds it in L2:

- ``w8a8``: activations quantized per token, XLA's FP8 x FP8 dot;
- ``weight_only``: the weight converted to bf16 in the dot's operand;
- ``bf16``: the unquantized weight, the peer the FP8 weights must beat.

Each also runs with cuBLAS GEMMs (``/cublas``: ``xla_gpu_enable_triton_gemm=False``,
the step programs' option from 64 rows). Floors measured in the same run: the
weight's bytes (FP8, or bf16 for the peer) plus the activations' over the copy
rate, and the FLOPs over the FP8 (bf16) matmul rate. ``reads_fp8_weight`` says whether
the compiled product takes the ``f8e4m3fn`` weight itself as an operand (a cuBLASLt
FP8 GEMM, a Triton fusion, or at a few rows XLA's fused matrix-vector reduction)
with no bf16 or float32 copy of the weight: the check that W8A8 did not fall back
to a wider GEMM.

Off a GPU the calls are timed by the wall clock (``timer``), and ``--scale``
shrinks the shapes so that the script runs on a CPU in seconds (the test
suite's check).

    python -m benchmarks.fp8_matmul --rows 1 64 8192 --out fp8_matmul.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import cupti_kernel_timings, device_facts, has_cupti, measure_floors, ms_by_kernel, write_json
from benchmarks.matmul_step import L2_BYTES, PROJECTIONS
from jaxrunner.ops.fp8_matmul import fp8_matmul, quantize_weight
from jaxrunner.roofline import matmul_flops_per_s

CUBLAS: Any = {"xla_gpu_enable_triton_gemm": False}
IMPLEMENTATIONS = ("w8a8", "weight_only", "bf16")


def call_for(impl: str):
    """``impl``'s product of ``x`` by one weight copy (``(values, scales)``, or the bf16 ``[out, in]`` weight)."""
    if impl == "bf16":
        return lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=x.dtype)
    return lambda x, w: fp8_matmul(x, w[0], w[1], None, impl=impl, dtype=x.dtype)


def reads_fp8_weight(hlo: str, out_features: int, in_features: int) -> bool:
    """Whether the optimized program's product takes the FP8 weight itself as an operand (an FP8 GEMM, or at
    a few rows a fused FP8 matrix-vector product), directly or through bitcasts (free views: XLA splits K into
    a batch that way), and holds no wider copy of the weight."""
    if re.search(rf"(bf16|f16|f32)\[{out_features},{in_features}\]", hlo):
        return False
    weight = re.search(rf"(%\S+) = f8e4m3fn\[{out_features},{in_features}\]\S* parameter", hlo)
    if weight is None:
        return False
    views = [weight.group(1)]
    for name in views:  # grows while bitcasts of a view are found
        views += re.findall(rf"(%\S+) = f8e4m3fn\[[\d,]*\]\S* bitcast\({re.escape(name)}\)", hlo)
    names = "|".join(map(re.escape, views))
    return re.search(rf"(custom-call|dot|fusion)\([^)\n]*({names})[,)]", hlo) is not None


def time_calls(compiled, x, weights, repeats: int) -> dict[str, Any]:
    """Seconds per call over ``repeats`` passes over the weight copies: CUPTI's kernel time on a GPU, the
    wall time elsewhere."""
    for w in weights:
        jax.block_until_ready(compiled(x, w))

    def passes():
        for _ in range(repeats):
            for w in weights:
                compiled(x, w)
        jax.block_until_ready(compiled(x, weights[0]))

    calls = repeats * len(weights) + 1
    if not has_cupti():
        start = time.perf_counter()
        passes()
        return dict(kernel_s=(time.perf_counter() - start) / calls, timer="wall")
    per_kernel = ms_by_kernel(cupti_kernel_timings(passes))
    top = max(per_kernel, key=lambda name: per_kernel[name])
    return dict(kernel_s=sum(per_kernel.values()) / 1e3 / calls, top_kernel=top[:100], timer="cupti")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--projections",
        nargs="+",
        choices=[name for name, _, _ in PROJECTIONS],
        default=[name for name, _, _ in PROJECTIONS if name != "lm_head"],  # the lm_head stays bf16
    )
    parser.add_argument("--scale", type=int, default=1, help="divide every projection's sizes by this (toy runs)")
    parser.add_argument("--floor-elements", type=int, default=1 << 30, help="bf16 elements of the copy test (2 GiB)")
    parser.add_argument("--out", default="fp8_matmul.json")
    args = parser.parse_args()
    projections = [(name, k // args.scale, n // args.scale) for name, k, n in PROJECTIONS if name in args.projections]
    facts = device_facts()
    floors = measure_floors(args.floor_elements)
    floors["fp8_matmul_flops_per_s"] = matmul_flops_per_s(
        8192 if args.floor_elements >= 1 << 28 else 256, jnp.float8_e4m3fn
    )
    copy = floors["copy_bytes_per_s"]
    key = jax.random.key(0)
    quantize = jax.jit(quantize_weight)
    rows = []
    for name, k, n in projections:
        copies = max(2, -(-2 * L2_BYTES // (k * n))) if has_cupti() else 2  # FP8 copies past L2
        bf16 = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
        fp8 = [quantize(w) for w in bf16]
        for m in args.rows:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.bfloat16)
            reference = np.asarray(call_for("bf16")(x, bf16[0]), np.float32)
            for impl in IMPLEMENTATIONS:
                weights = bf16 if impl == "bf16" else fp8
                weight_bytes = k * n * (2 if impl == "bf16" else 1)
                matmul_rate = floors["fp8_matmul_flops_per_s" if impl == "w8a8" else "matmul_flops_per_s"]
                for variant, options in ((impl, None), (f"{impl}/cublas", CUBLAS)):
                    start = time.perf_counter()
                    row: dict[str, Any] = dict(projection=name, rows=m, variant=variant, impl=impl)
                    try:
                        compiled = jax.jit(call_for(impl)).lower(x, weights[0]).compile(compiler_options=options)
                        got = np.asarray(compiled(x, weights[0]), np.float32)
                        row["rel_error"] = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
                        if impl == "w8a8":
                            row["reads_fp8_weight"] = reads_fp8_weight(compiled.as_text() or "", n, k)
                        row.update(time_calls(compiled, x, weights, args.repeats))
                    except Exception as exc:  # an option this XLA lacks, say: keep the other variants
                        row["error"] = repr(exc)[:500]
                    row["copy_floor_s"] = (weight_bytes + 2 * m * (k + n)) / copy
                    row["matmul_floor_s"] = 2 * m * k * n / matmul_rate
                    row["floor_s"] = max(row["copy_floor_s"], row["matmul_floor_s"])
                    row["seconds_to_measure"] = time.perf_counter() - start
                    if "kernel_s" in row:
                        row["over_floor"] = row["kernel_s"] / row["floor_s"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del bf16, fp8
    for row in rows:  # each against the bf16 peer of its projection, rows and GEMM choice
        peer = next(
            (
                r
                for r in rows
                if (r["projection"], r["rows"], r["impl"]) == (row["projection"], row["rows"], "bf16")
                and r["variant"].endswith("/cublas") == row["variant"].endswith("/cublas")
            ),
            None,
        )
        if peer is not None and "kernel_s" in row and "kernel_s" in peer:
            row["speedup_over_bf16"] = peer["kernel_s"] / row["kernel_s"]
    result = dict(**facts, **floors, rows=rows)
    write_json(args.out, result)
    print(
        f"\n{result['device']}, copy {copy / 1e12:.2f} TB/s, bf16 matmul {floors['matmul_flops_per_s'] / 1e12:.0f} "
        f"TFLOP/s, FP8 matmul {floors['fp8_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; "
        "us per call / over its floor / speed-up over bf16"
    )
    for name, _, _ in projections:
        for m in args.rows:
            cells = [r for r in rows if r["projection"] == name and r["rows"] == m]
            print(f"{name} {m}: " + ", ".join(f"{r['variant']} {_cell(r)}" for r in cells))


def _cell(row: dict[str, Any]) -> str:
    if "kernel_s" not in row:
        return "error"
    return f"{row['kernel_s'] * 1e6:.1f}/{row['over_floor']:.2f}/{row.get('speedup_over_bf16', 1.0):.2f}"


if __name__ == "__main__":
    main()
