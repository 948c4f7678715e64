"""Ways to lay out and multiply multi-LoRA weights, on Llama-3-8B's projections: step time against none.

A step of ``--layers`` layers of the four merged projections alone (q/k/v, o,
gate/up, down; no attention, no norms), ``--loras`` adapters of ``--rank`` on
every projection, tokens spread over them, at each row count. Each way adds
the same product ``B_s A_s x`` to every projection:

- ``per_module``: each HF module's own ``A [slot, in, rank]`` and ``B``, as the
  runner first did;
- ``grouped``: one ``A [in, module * slot * rank]`` per merged projection, the
  tokens' slot mask, one block-diagonal ``B``;
- ``grouped_t``: the same with ``A`` stored ``[module * slot * rank, in]``;
- ``columns``: ``A``'s columns appended to the base weight, so that one matmul
  gives the projection and the shrink (the runner's layout).

The weights are arguments of the compiled step (never constants); on a GPU a step
of ``CUBLAS_MIN_ROWS`` rows or more takes cuBLAS for its matmuls, as the runner's
do. ``--scale``
divides every width so that the script runs on a CPU in seconds (the test
suite's check).

    python -m benchmarks.lora_layouts --rows 1 64 --out lora_layouts.json
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from benchmarks.harness import device_facts, write_json
from jaxrunner.config import CUBLAS_GEMMS, CUBLAS_MIN_ROWS
from jaxrunner.roofline import median_seconds

HIDDEN, Q, KV, FEATURES = 4096, 4096, 1024, 14336
WAYS = ("plain", "per_module", "grouped", "grouped_t", "columns")


def projections(scale: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each merged projection's input width and its modules' output widths."""
    h, q, kv, f = HIDDEN // scale, Q // scale, KV // scale, FEATURES // scale
    return {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (f, f)), "down": (f, (h,))}


def random_weights(shapes, layers: int, loras: int, rank: int) -> dict:
    """Base weights and every layout's adapter weights, bf16, one array per layer and projection."""
    key = iter(jax.random.split(jax.random.key(0), 10_000))
    rnd = lambda shape: (jax.random.normal(next(key), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    w: dict = {"base": {}, "a_module": {}, "b_module": {}, "a": {}, "a_t": {}, "b": {}, "base_a": {}}
    for name, (n_in, outs) in shapes.items():
        n = len(outs) * loras * rank
        for layer in range(layers):
            k = (name, layer)
            w["base"][k] = rnd((n_in, sum(outs)))
            w["a_module"][k] = [rnd((loras, n_in, rank)) for _ in outs]
            w["b_module"][k] = [rnd((loras, rank, out)) for out in outs]
            w["a"][k] = rnd((n_in, n))
            w["a_t"][k] = jnp.asarray(w["a"][k].T)
            w["b"][k] = block_diagonal([rnd((loras * rank, out)) for out in outs])
            w["base_a"][k] = jnp.concatenate([w["base"][k], w["a"][k]], axis=1)
    return w


def block_diagonal(parts: list[jax.Array]) -> jax.Array:
    """Each module's ``B`` rows in its own output columns."""
    out = sum(p.shape[1] for p in parts)
    rows, column = [], 0
    for p in parts:
        rows.append(jnp.pad(p, ((0, 0), (column, out - column - p.shape[1]))))
        column += p.shape[1]
    return jnp.concatenate(rows, axis=0)


def expand(shrunk, mask, b, modules: int, loras: int, rank: int):
    """Keep each token's own slot of the shrunk product, then one matmul by the block-diagonal ``B``."""
    shrunk = shrunk.reshape(-1, modules, loras, rank) * mask.astype(shrunk.dtype)[:, None, :, None]
    return jnp.dot(shrunk.reshape(shrunk.shape[0], -1), b)


def step(way: str, shapes, layers: int, loras: int, rank: int, w: dict, x, slots):
    """The layers' projections with ``way``'s LoRA product."""
    mask = slots[:, None] == jnp.arange(loras)[None, :]

    def project(name: str, layer: int, h):
        k, modules = (name, layer), len(shapes[name][1])
        if way == "columns":
            both = jnp.dot(h, w["base_a"][k])
            width = sum(shapes[name][1])
            return both[:, :width] + expand(both[:, width:], mask, w["b"][k], modules, loras, rank)
        y = jnp.dot(h, w["base"][k])
        if way == "plain":
            return y
        if way == "per_module":
            deltas = []
            for a, b in zip(w["a_module"][k], w["b_module"][k]):
                s = jnp.einsum("ti,sir->tsr", h, a) * mask.astype(h.dtype)[:, :, None]
                deltas.append(jnp.einsum("tsr,sro->to", s, b))
            return y + jnp.concatenate(deltas, axis=1)
        shrunk = jnp.dot(h, w["a"][k]) if way == "grouped" else jnp.einsum("ti,ni->tn", h, w["a_t"][k])
        return y + expand(shrunk, mask, w["b"][k], modules, loras, rank)

    q_width, features = shapes["o"][0], shapes["down"][0]
    for layer in range(layers):
        x = x + project("o", layer, project("qkv", layer, x)[:, :q_width])
        gate_up = project("gate_up", layer, x)
        x = x + project("down", layer, jax.nn.silu(gate_up[:, :features]) * gate_up[:, features:])
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--scale", type=int, default=1, help="divide every width by this")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="lora_layouts.json")
    args = parser.parse_args()

    shapes = projections(args.scale)
    weights = random_weights(shapes, args.layers, args.loras, args.rank)
    rows = []
    for num_rows in args.rows:
        x = jax.random.normal(jax.random.key(1), (num_rows, shapes["qkv"][0]), jnp.bfloat16)
        slots = jnp.arange(num_rows, dtype=jnp.int32) % args.loras
        gpu = jax.devices()[0].platform == "gpu"
        options = CUBLAS_GEMMS if gpu and num_rows >= CUBLAS_MIN_ROWS else {}
        row: dict = {"rows": num_rows}
        for way in WAYS:
            lowered = jax.jit(functools.partial(step, way, shapes, args.layers, args.loras, args.rank)).lower(
                weights, x, slots
            )
            run = lowered.compile(dict(options))  # pyright: ignore[reportArgumentType]  (XLA takes ints too)
            row[f"{way}_ms"] = median_seconds(functools.partial(run, weights, x, slots), args.repeats) * 1e3
        for way in WAYS[1:]:
            row[f"{way}_over_plain"] = row[f"{way}_ms"] / row["plain_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_json(args.out, dict(benchmark="lora_layouts", **device_facts(), args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
