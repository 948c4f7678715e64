"""One mixture-of-experts layer's expert products (Qwen3-30B-A3B's shape) against the copy floor, per way.

A decode step's experts read only the experts its tokens were routed to, so the
floor of one layer is those experts' bytes (counted from the routing of random
tokens) over the copy bandwidth measured in the same run. Each way runs the
layer's two products (gate/up, then down) with the routing applied:

- ``grouped``: the model's path (``models/moe.experts_forward``): the (token,
  expert) pairs sorted by expert, then ``ops/grouped_matmul`` (XLA's
  ``ragged_dot``);
- ``per_expert_loop``: every expert multiplies every row, masked to its own:
  the dense product a static-shape loop over experts amounts to;
- ``gathered``: the model's ``gathered`` path: each (token, expert) pair
  gathers its expert's matrices and multiplies its one row (reads one matrix a
  pair: the floor while pairs are fewer than experts);
- ``grouped_kernel``: the model's path with ``ops/grouped_matmul_mgpu``'s
  Mosaic GPU kernel (Hopper only: left out on other backends), which reads
  only the touched experts;
- ``grouped_jax_example``: the peer, the model's path with JAX's own Mosaic GPU
  ``ragged_dot`` example kernel (``jax.experimental.pallas.ops.gpu``, Hopper
  only), at 64 x 128 x 64 blocks and 4 stages like ours.

``--scale`` divides the widths so that the script runs on a CPU in seconds (the
test suite's check).

    python -m benchmarks.moe_matmul --tokens 1 64 --out moe_matmul.json
"""

from __future__ import annotations

import argparse
import functools
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import SHAPES, device_facts, measure_floors, write_json
from jaxrunner.models.layers import ACTIVATIONS
from jaxrunner.models.moe import experts_forward, route
from jaxrunner.roofline import median_seconds

ACT = ACTIVATIONS["silu"]


def per_expert_loop(x, weights, experts, gate_up, down):
    """Each expert over every row, its rows' outputs kept by the routing mask."""
    num_experts, _, _, features = gate_up.shape
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(num_experts):
        share = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=-1)  # [tokens]
        h = jnp.einsum("th,hsf->tsf", x, gate_up[e])
        out = out + share[:, None] * (ACT(h[:, 0]) * h[:, 1] @ down[e]).astype(jnp.float32)
    return out.astype(x.dtype)


def gathered(x, weights, experts, gate_up, down):
    return experts_forward(x, weights, experts, gate_up, down, ACT, impl="gathered")


def grouped(x, weights, experts, gate_up, down):
    return experts_forward(x, weights, experts, gate_up, down, ACT)


def grouped_kernel(x, weights, experts, gate_up, down):
    return experts_forward(x, weights, experts, gate_up, down, ACT, impl="mgpu")


def grouped_jax_example(x, weights, experts, gate_up, down):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    def example(lhs, rhs, sizes, impl):
        return ragged_dot_mgpu.ragged_dot(
            lhs, rhs, group_sizes=sizes, block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
        )

    with mock.patch("jaxrunner.models.moe.grouped_matmul", example):
        return experts_forward(x, weights, experts, gate_up, down, ACT)


WAYS = {
    "grouped": grouped,
    "per_expert_loop": per_expert_loop,
    "gathered": gathered,
    "grouped_kernel": grouped_kernel,
    "grouped_jax_example": grouped_jax_example,
}
GPU_ONLY = ("grouped_kernel", "grouped_jax_example")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--scale", type=int, default=1, help="divide hidden and expert widths by this")
    parser.add_argument("--ways", nargs="+", choices=sorted(WAYS), help="default: every way the backend runs")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--floor-elements", type=int, default=1 << 30)
    parser.add_argument("--out", default="moe_matmul.json")
    args = parser.parse_args()

    arch = SHAPES["qwen3-30b-a3b"]
    assert arch.moe is not None
    hidden, features = arch.hidden_size // args.scale, arch.moe.intermediate_size // args.scale
    num_experts, top_k = arch.moe.num_experts, arch.moe.top_k
    ways = args.ways or [w for w in WAYS if jax.default_backend() == "gpu" or w not in GPU_ONLY]
    floors = measure_floors(args.floor_elements)
    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = (jax.random.normal(keys[0], (num_experts, hidden, 2, features), jnp.float32) * 0.02).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[1], (num_experts, features, hidden), jnp.float32) * 0.02).astype(jnp.bfloat16)
    expert_bytes = (gate_up.size + down.size) * 2 // num_experts
    rows = []
    for tokens in args.tokens:
        x = jax.random.normal(keys[2], (tokens, hidden), jnp.bfloat16)
        router = jax.random.normal(jax.random.fold_in(keys[3], tokens), (tokens, num_experts), jnp.float32)
        weights, experts = route(router, top_k, arch.moe.renormalize)
        touched = len(np.unique(np.asarray(experts)))
        floor = touched * expert_bytes / floors["copy_bytes_per_s"]
        row: dict = dict(tokens=tokens, experts_touched=touched, floor_ms=floor * 1e3)
        if "grouped" in ways:
            reference = jax.jit(grouped)(x, weights, experts, gate_up, down)
            for name in ways:
                got = jax.jit(WAYS[name])(x, weights, experts, gate_up, down)
                row[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - reference)))
        for name in ways:
            run = functools.partial(jax.jit(WAYS[name]), x, weights, experts, gate_up, down)
            seconds = median_seconds(run, args.repeats)
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_ratio"] = seconds / floor
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_json(
        args.out,
        dict(
            benchmark="moe_matmul",
            **device_facts(),
            hidden_size=hidden,
            expert_features=features,
            num_experts=num_experts,
            top_k=top_k,
            **floors,
            rows=rows,
        ),
    )


if __name__ == "__main__":
    main()
