"""Ragged paged attention on Llama-3-8B shapes: our kernel against its floors and peers.

Measures, in one run: the device's copy bandwidth (JAX, and PyTorch's
device-to-device copy where torch is installed; the higher is the floor) and its
bf16 matmul rate; then for each case our Mosaic GPU kernel, the pure-JAX
reference, and the shipped Pallas baselines where they apply
(``jax.experimental.pallas.ops.gpu.paged_attention`` for decode,
``attention_mgpu`` for dense causal prefill). Each case is also checked against
the reference (max error relative to the largest output).

Decode is reported as effective KV bandwidth (bytes of K and V read / time) over
the copy bandwidth; prefill as TFLOP/s (causal FLOPs) over the matmul rate.
``--sweep`` instead times the tuning table's choice against its neighbours on
the cases the table is tuned for, each checked against the reference;
``--kv-write`` times the KV cache write, XLA's scatter against the Mosaic GPU kernel.

Off a GPU our kernel runs through the Mosaic GPU interpreter (about half a
minute a call at toy size), CUPTI and the shipped GPU baselines are skipped,
and only the wall time is recorded; ``--implementations reference`` times the
reference alone: with ``--heads small --only decode:2:64 --implementations
reference --repeats 1 --floor-elements 65536`` the script runs on a CPU in
seconds (the test suite's check).

    python -m benchmarks.attention_step --out attention_step.json
    python -m benchmarks.attention_step --sweep --out attention_sweep.json
    python -m benchmarks.attention_step --kv-write --out kv_write.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (
    cupti_kernel_timings,
    device_facts,
    has_cupti,
    measure_floors,
    ms_by_kernel,
    write_json,
)
from jaxrunner.ops.attention_backend import AttentionBackend
from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.attention_mgpu import (
    KernelConfig,
    compute_dtype,
    config_for,
    device_sms,
    launch_kernel,
    prepare_tiles,
    ragged_paged_attention_mgpu,
)
from jaxrunner.ops.attention_reference import ragged_paged_attention_reference

BLOCK_SIZE = 16
CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Heads:
    """The attention's heads: query heads, KV heads, and their size."""

    num_q: int
    num_kv: int
    dim: int

    @property
    def sm_scale(self) -> float:
        return self.dim**-0.5


# Llama-3-8B's, and the kernel tests' small heads (a toy run through the Mosaic GPU interpreter on a CPU).
HEADS = {"llama3-8b": Heads(32, 8, 128), "small": Heads(4, 2, 64)}
LLAMA3_8B = HEADS["llama3-8b"]


def seconds(fn, *args, repeats: int = 10, traced_repeats: int = 3, inner: int = 10) -> dict:
    """Per call of ``fn(*args)``: wall seconds, the median over ``repeats`` runs of one program of
    ``inner`` calls; then, from CUPTI over ``traced_repeats`` further runs, the device seconds of
    all its kernels and of the longest-running one (the kernel under test).

    The calls are unrolled, not a device loop: a loop XLA keeps on the host would add
    a host round trip to every call and swamp a microsecond-scale kernel. Wall time still
    counts any gap while the host launches the next kernel; device time does not. Both
    include the harness's own small kernels (the dependency add and the output sums).
    Off a GPU (or with nothing recorded) only the wall time is returned.
    """

    @jax.jit
    def looped(first, *rest):
        acc = jnp.float32(0)
        for _ in range(inner):
            # The first input depends on the previous call so that XLA can neither merge nor reorder the calls.
            out = fn(first + (acc * 0).astype(first.dtype), *rest)
            acc = acc + sum(x.sum(dtype=jnp.float32) for x in jax.tree.leaves(out))
        return acc

    looped(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        looped(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    result = {"s": statistics.median(times) / inner}

    if not has_cupti():
        return result

    def traced_runs():
        for _ in range(traced_repeats):
            looped(*args).block_until_ready()

    try:
        timings = cupti_kernel_timings(traced_runs)
    except Exception as exc:  # CUPTI unavailable: keep the wall time
        result["device_error"] = repr(exc)[:300]
        return result
    kernel_ms = ms_by_kernel(timings)
    if kernel_ms:
        calls = traced_repeats * inner
        top = max(kernel_ms, key=lambda name: kernel_ms[name])
        result.update(
            device_s=sum(kernel_ms.values()) / 1e3 / calls, top_kernel=top[:80], kernel_s=kernel_ms[top] / 1e3 / calls
        )
    return result


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    heads: Heads,
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
    cache_dtype=jnp.bfloat16,
):
    """q, paged caches of ``block_size``-token pages with shuffled block tables, and metadata for these requests;
    the caches in ``cache_dtype`` (bf16 values rounded to FP8 for an FP8 cache), q in bf16."""
    rng = np.random.default_rng(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), max(blocks)), np.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[at : at + n]
        at += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    metadata = AttentionMetadata(
        jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(table), jnp.zeros(num_tokens, jnp.int32)
    )
    key = jax.random.key(seed)
    shape = (num_blocks, block_size, heads.num_kv, heads.dim)
    k_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16).astype(cache_dtype)
    v_cache = jax.random.normal(jax.random.fold_in(key, 2), shape, jnp.bfloat16).astype(cache_dtype)
    q = jax.random.normal(jax.random.fold_in(key, 3), (num_tokens, heads.num_q, heads.dim), jnp.bfloat16)
    return q, k_cache, v_cache, metadata


def widened_reference(heads: Heads):
    """The jitted pure-JAX reference, reading the cache's values widened to q's dtype (exact for FP8)."""
    reference = functools.partial(ragged_paged_attention_reference, sm_scale=heads.sm_scale)
    return jax.jit(lambda q, k, v, metadata: reference(q, k.astype(q.dtype), v.astype(q.dtype), metadata))


def max_rel_error(got, expected) -> float:
    """Largest absolute difference relative to the largest reference output."""
    got, expected = got.astype(jnp.float32), expected.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - expected)) / jnp.max(jnp.abs(expected)))


def kv_bytes(seq_lens: list[int], heads: Heads, itemsize: int = 2) -> int:
    """Bytes of K and V the requests' keys take in a cache of ``itemsize``-byte elements."""
    return 2 * sum(seq_lens) * heads.num_kv * heads.dim * itemsize


def causal_flops(q_lens: list[int], seq_lens: list[int], heads: Heads) -> float:
    """QK and PV FLOPs over the visible (query, key) pairs."""
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(q_lens, seq_lens))
    return 4 * heads.num_q * heads.dim * pairs


def kernel_only(q, k_cache, v_cache, metadata, heads: Heads):
    """Our kernel without the wrapper's XLA ops (schedule, query gather, output gather, combine),
    to show how the time splits between them."""
    config = config_for(q, k_cache, metadata)
    prepare = jax.jit(prepare_tiles, static_argnums=(1, 3), static_argnames="sliding_window")
    q = q.astype(compute_dtype(q.dtype, k_cache.dtype))
    schedule, q_packed = prepare(q, heads.num_kv, metadata, config, sliding_window=None)

    def fn(q_packed, fields, block_tables, k_cache, v_cache, **kwargs):
        return launch_kernel(
            fields,
            block_tables,
            q_packed,
            k_cache,
            v_cache,
            config=config,
            group=heads.num_q // heads.num_kv,
            sm_scale=heads.sm_scale,
            sliding_window=None,
            soft_cap=None,
            interpret=AttentionBackend.default().interpreter(),
            **kwargs,
        )

    return fn, (q_packed, schedule.fields, metadata.block_tables, k_cache, v_cache)


def decode_baseline(q, k_cache, v_cache, metadata):
    """The shipped Triton-style decode kernel, on its own cache layout ([kv heads, pages, ...])."""
    from jax.experimental.pallas.ops.gpu import paged_attention

    k_pages = jnp.transpose(k_cache, (2, 0, 1, 3))
    v_pages = jnp.transpose(v_cache, (2, 0, 1, 3))
    pages = metadata.block_tables.shape[1]
    splits = max(d for d in (1, 2, 4, 8, 16) if pages % d == 0)
    fn = functools.partial(
        paged_attention.paged_attention, pages_per_compute_block=min(8, pages // splits), k_splits=splits
    )
    return (lambda q, kp, vp, bt, ln: fn(q, kp, vp, bt, ln)), (
        q,
        k_pages,
        v_pages,
        metadata.block_tables,
        metadata.seq_lens,
    )


def prefill_baseline(q, k_cache, v_cache, metadata, q_lens):
    num_q_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    """The shipped dense FlashAttention-3 (Mosaic GPU), causal, on contiguous [batch, seq, heads, dim]."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    batch, seq = len(q_lens), q_lens[0]
    blocks = metadata.block_tables
    k = k_cache[blocks].reshape(batch, -1, num_kv_heads, head_dim)[:, :seq]
    v = v_cache[blocks].reshape(batch, -1, num_kv_heads, head_dim)[:, :seq]
    qb = q.reshape(batch, seq, num_q_heads, head_dim)
    qb, k, v = (x.astype(jnp.float16) for x in (qb, k, v))  # its shared memory is float16
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return (lambda q, k, v: attention_mgpu.attention(q, k, v, config)), (qb, k, v)


BASELINE_NAMES = {"decode": "pallas_paged_attention", "prefill": "pallas_attention_mgpu"}

CASES = [("decode", b, c) for b in (1, 16, 64, 256) for c in (1024, 4096, 32768)] + [
    ("prefill", 1, 8192),
    ("prefill", 8, 2048),
    ("mixed", 64, 4096),
]


def lengths(kind: str, batch: int, context: int) -> tuple[list[int], list[int]]:
    if kind == "decode":
        return [1] * batch, [context] * batch
    if kind == "prefill":
        return [context] * batch, [context] * batch
    # Mixed: decodes at `context`, two chunked prefills of 512 on top of 2k, one fresh 1000-token prefill.
    return [1] * batch + [512, 512, 1000], [context] * batch + [2560, 2560, 1000]


def baseline(kind, q, k_cache, v_cache, metadata, q_lens):
    """The shipped kernel that applies to this case, as (fn, args), or None (always off a GPU: they are GPU kernels)."""
    if jax.default_backend() != "gpu" or k_cache.dtype.itemsize != 2:  # GPU kernels over 16-bit caches
        return None
    if kind == "decode":
        return decode_baseline(q, k_cache, v_cache, metadata)
    if kind == "prefill":
        return prefill_baseline(q, k_cache, v_cache, metadata, q_lens)
    return None


# What run_case times: our kernel (checked against the reference), the kernel without the wrapper's XLA ops,
# the pure-JAX reference, and the shipped Pallas kernel that applies (on a GPU).
IMPLEMENTATIONS = ("ours", "ours_kernel_only", "reference", "baseline")


def run_case(
    kind,
    batch,
    context,
    floors,
    heads: Heads = LLAMA3_8B,
    block_size: int = BLOCK_SIZE,
    repeats: int = 10,
    implementations=IMPLEMENTATIONS,
    cache_dtype=jnp.bfloat16,
) -> dict:
    q_lens, seq_lens = lengths(kind, batch, context)
    q, k_cache, v_cache, metadata = make_case(q_lens, seq_lens, heads, block_size, cache_dtype=cache_dtype)
    ours = jax.jit(
        functools.partial(
            ragged_paged_attention_mgpu, sm_scale=heads.sm_scale, interpret=AttentionBackend.default().interpreter()
        )
    )
    ref = widened_reference(heads)
    row = {
        "kind": kind,
        "batch": batch,
        "context": context,
        "cache_dtype": jnp.dtype(cache_dtype).name,
        "kv_bytes": kv_bytes(seq_lens, heads, jnp.dtype(cache_dtype).itemsize),
        "flops": causal_flops(q_lens, seq_lens, heads),
    }
    started = time.perf_counter()
    timed = {}
    if "ours" in implementations:
        row["max_rel_error"] = max_rel_error(ours(q, k_cache, v_cache, metadata), ref(q, k_cache, v_cache, metadata))
        timed["ours"] = (ours, (q, k_cache, v_cache, metadata))
    if "reference" in implementations:
        timed["reference"] = (ref, (q, k_cache, v_cache, metadata))
    if "ours_kernel_only" in implementations:
        timed["ours_kernel_only"] = kernel_only(q, k_cache, v_cache, metadata, heads)
    try:
        if "baseline" in implementations and (shipped := baseline(kind, q, k_cache, v_cache, metadata, q_lens)):
            timed[BASELINE_NAMES[kind]] = shipped
    except Exception as exc:
        row["baseline_error"] = repr(exc)
    row["check_and_setup_s"] = time.perf_counter() - started
    for name, (fn, args) in timed.items():
        started = time.perf_counter()
        try:
            timing = seconds(fn, *args, repeats=repeats)
        except Exception as exc:
            row[f"{name}_error"] = "".join(traceback.format_exception_only(exc))[-2000:]
            continue
        for key in ("top_kernel", "device_error"):
            if key in timing:
                row[f"{name}_{key}"] = timing.pop(key)
        for measure, t in timing.items():  # s (wall), device_s, kernel_s
            row[f"{name}_{measure}"] = t
            label = name if measure == "s" else f"{name}_{measure.removesuffix('_s')}"
            row[f"{label}_kv_bw_fraction"] = row["kv_bytes"] / t / floors["copy_bytes_per_s"]
            row[f"{label}_matmul_fraction"] = row["flops"] / t / floors["matmul_flops_per_s"]
        row[f"{name}_elapsed_s"] = time.perf_counter() - started  # compiling included: where a run's time goes
    del q, k_cache, v_cache
    return row


def candidate_configs(base: KernelConfig, widened: bool = False) -> dict[str, KernelConfig]:
    """The table's choice and its neighbours: each switch flipped (register split, in-place
    accumulation, and with two compute warpgroups ping-pong and longest first), ring sizes,
    (over an FP8 cache, ``widened``) the widened ring's depth traded against the FP8 ring's, and
    (decode) split counts."""
    registers = (232 if base.num_compute_wgs == 2 else 216) if base.compute_registers is None else None
    flip = lambda **fields: dataclasses.replace(base, **fields)
    options = {
        "table": base,
        "registers_flipped": flip(compute_registers=registers),
        "in_place_flipped": flip(accumulate_in_place=not base.accumulate_in_place),
        "stages-1": flip(num_stages=max(base.num_stages - 1, 2)),
        "stages+1": flip(num_stages=base.num_stages + 1),
        "pages*2": flip(pages_per_stage=base.pages_per_stage * 2, num_stages=2),
        "persistent_flipped": flip(num_programs=None if base.num_programs else device_sms()),
        **(
            {
                "widened-1,stages+2": flip(num_widened_stages=1, num_stages=base.num_stages + 2),
                "widened+1": flip(num_widened_stages=base.num_widened_stages + 1),
                # Scores in FP8 (e4m3 caches; their error counts the queries' rounding, which the widened
                # reference does not do), and with a deeper FP8 ring, which the keys are now read from.
                "fp8_scores_flipped": flip(fp8_scores=not base.fp8_scores),
                "fp8_scores_flipped,stages+1": flip(fp8_scores=not base.fp8_scores, num_stages=base.num_stages + 1),
            }
            if widened
            else {}
        ),
        # Two widening warpgroups beside one compute warpgroup (a third beside two would not have the registers).
        **(
            {
                "widening_wgs_flipped": flip(num_widening_wgs=3 - base.num_widening_wgs),
                "persistent_and_widening_wgs_flipped": flip(
                    num_widening_wgs=3 - base.num_widening_wgs,
                    num_programs=None if base.num_programs else device_sms(),
                ),
            }
            if widened and base.num_compute_wgs == 1
            else {}
        ),
        **(
            {
                "pingpong_flipped": flip(pingpong=not base.pingpong),
                "longest_first_flipped": flip(longest_first=not base.longest_first),
                "pingpong_and_longest_first_flipped": flip(
                    pingpong=not base.pingpong, longest_first=not base.longest_first
                ),
            }
            if base.num_compute_wgs == 2
            else {}
        ),
        # Decode: every split count from one program per tile to 16, to see where wave quantization bites.
        **{f"splits={n}": flip(num_kv_splits=n) for n in (1, 2, 3, 4, 6, 8, 16) if base.num_compute_wgs == 1},
    }
    unique: dict[KernelConfig, str] = {}
    for name, config in options.items():
        unique.setdefault(config, name)
    return {name: config for config, name in unique.items()}


def sweep_case(
    kind,
    batch,
    context,
    heads: Heads = LLAMA3_8B,
    block_size: int = BLOCK_SIZE,
    cache_dtype=jnp.bfloat16,
    only_candidates: list[str] | None = None,
) -> dict:
    """Time and check every candidate config of one case (those named in ``only_candidates``, if given),
    and the shipped baseline in the same run; the fastest correct config wins."""
    q_lens, seq_lens = lengths(kind, batch, context)
    q, k_cache, v_cache, metadata = make_case(q_lens, seq_lens, heads, block_size, cache_dtype=cache_dtype)
    expected = widened_reference(heads)(q, k_cache, v_cache, metadata)
    base = config_for(q, k_cache, metadata)
    row = {
        "kind": kind,
        "batch": batch,
        "context": context,
        "cache_dtype": jnp.dtype(cache_dtype).name,
        "kv_bytes": kv_bytes(seq_lens, heads, jnp.dtype(cache_dtype).itemsize),
        "configs": {},
    }
    candidates = candidate_configs(base, widened=jnp.dtype(cache_dtype).itemsize < q.dtype.itemsize)
    for name, config in candidates.items():
        if only_candidates and name not in only_candidates:
            continue
        entry: dict[str, Any] = {"config": dataclasses.asdict(config)}
        try:
            fn = jax.jit(
                functools.partial(
                    ragged_paged_attention_mgpu,
                    sm_scale=heads.sm_scale,
                    config=config,
                    interpret=AttentionBackend.default().interpreter(),
                )
            )
            entry["max_rel_error"] = max_rel_error(fn(q, k_cache, v_cache, metadata), expected)
            entry.update(seconds(fn, q, k_cache, v_cache, metadata))
        except Exception as exc:
            entry["error"] = "".join(traceback.format_exception_only(exc))[-1500:]
        row["configs"][name] = entry
        print(kind, batch, context, name, {k: v for k, v in entry.items() if k != "config"}, flush=True)
    try:
        if (shipped := baseline(kind, q, k_cache, v_cache, metadata, q_lens)) is not None:
            fn, args = shipped
            row[BASELINE_NAMES[kind]] = seconds(fn, *args)
    except Exception as exc:
        row["baseline_error"] = "".join(traceback.format_exception_only(exc))[-1500:]
    shipped = BASELINE_NAMES.get(kind, "baseline_error")  # a kind with no shipped kernel: its error, if any
    print(kind, batch, context, "baseline", row.get(shipped, row.get("baseline_error")), flush=True)
    return row


def kv_write_rows(token_counts=(1, 64, 256, 8192), num_blocks: int = 16384, repeats: int = 10) -> list[dict]:
    """Seconds per layer's KV write, XLA's scatter against the Mosaic GPU kernel, on Llama-3-8B's cache shape.

    Ten writes are chained in one program on donated caches (each in place), so a
    write's time is the program's over ten; distinct shuffled slots, as the runner writes.
    """
    from jaxrunner.ops.kv_write import write_kv

    rows = []
    for tokens in token_counts:
        rng = np.random.default_rng(tokens)
        slots = jnp.asarray(rng.permutation(num_blocks * BLOCK_SIZE)[:tokens], jnp.int32)
        key = jax.random.key(tokens)
        k_new = jax.random.normal(key, (tokens, LLAMA3_8B.num_kv, LLAMA3_8B.dim), jnp.bfloat16)
        v_new = jax.random.normal(jax.random.fold_in(key, 1), k_new.shape, jnp.bfloat16)
        row = {"tokens": tokens, "bytes_written": 2 * k_new.size * 2}
        for impl in ("reference", "mosaic_gpu"):

            @functools.partial(jax.jit, donate_argnums=(0, 1))
            def ten_writes(k_cache, v_cache, k_new, v_new, impl=impl, slots=slots):
                for i in range(10):  # distinct values per write, so no write is redundant
                    k_cache, v_cache = write_kv(k_cache, v_cache, k_new + i, v_new, slots, impl=impl)
                return k_cache, v_cache

            shape = (num_blocks, BLOCK_SIZE, LLAMA3_8B.num_kv, LLAMA3_8B.dim)
            caches = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
            try:
                caches = jax.block_until_ready(ten_writes(*caches, k_new, v_new))
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    caches = jax.block_until_ready(ten_writes(*caches, k_new, v_new))
                    times.append((time.perf_counter() - start) / 10)
                row[f"{impl}_s"] = statistics.median(times)
            except Exception as exc:
                row[f"{impl}_error"] = "".join(traceback.format_exception_only(exc))[-1500:]
            del caches
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


SWEEP_CASES = [
    ("decode", 1, 1024),
    ("decode", 16, 1024),
    ("decode", 1, 4096),
    ("decode", 64, 4096),
    ("prefill", 1, 8192),
    ("prefill", 8, 2048),
]


def parse_case(text: str) -> tuple[str, int, int]:
    """``"decode:64:4096"`` -> ("decode", 64, 4096)."""
    kind, batch, context = text.split(":")
    if kind not in ("decode", "prefill", "mixed"):
        raise argparse.ArgumentTypeError(f"a case is decode|prefill|mixed:BATCH:CONTEXT; got {text!r}")
    return kind, int(batch), int(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_step.json")
    parser.add_argument(
        "--only",
        type=parse_case,
        nargs="*",
        help="cases kind:batch:context to run (default: CASES, or SWEEP_CASES with --sweep)",
    )
    parser.add_argument("--sweep", action="store_true", help="time the tuning table's neighbours instead")
    parser.add_argument("--candidates", nargs="*", help="with --sweep, only these neighbours (e.g. table stages+1)")
    parser.add_argument("--kv-write", action="store_true", help="time the KV cache write's two implementations instead")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens a KV page holds")
    parser.add_argument(
        "--heads",
        choices=sorted(HEADS),
        default="llama3-8b",
        help="the attention's heads (small: the kernel tests', for a toy run on a CPU)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each implementation")
    parser.add_argument(
        "--implementations",
        nargs="+",
        choices=IMPLEMENTATIONS,
        default=list(IMPLEMENTATIONS),
        help="what to time (off a GPU our kernel is interpreted: half a minute a call)",
    )
    parser.add_argument("--floor-elements", type=int, default=1 << 30, help="bf16 elements of the copy test (2 GiB)")
    parser.add_argument(
        "--cache-dtype",
        choices=sorted(CACHE_DTYPES),
        default="bfloat16",
        help="the KV cache's dtype (fp8: bytes and bandwidth count FP8 bytes)",
    )
    args = parser.parse_args()
    heads = HEADS[args.heads]
    facts = device_facts()
    if args.kv_write:
        write_json(args.out, {**facts, "kv_write": kv_write_rows()})
        return
    if args.sweep:
        rows = []
        cases: list[tuple[str, int, int]] = args.only or SWEEP_CASES
        for kind, batch, context in cases:  # written after each case, so a cut-short run keeps what it measured
            rows.append(
                sweep_case(
                    kind, batch, context, heads, args.block_size, CACHE_DTYPES[args.cache_dtype], args.candidates
                )
            )
            write_json(args.out, {**facts, "heads": args.heads, "block_size": args.block_size, "sweep": rows})
        return
    floors = measure_floors(args.floor_elements)
    print(json.dumps(floors), flush=True)
    rows = []
    for kind, batch, context in args.only or CASES:
        try:
            row = run_case(
                kind,
                batch,
                context,
                floors,
                heads,
                args.block_size,
                args.repeats,
                args.implementations,
                CACHE_DTYPES[args.cache_dtype],
            )
        except Exception as exc:
            row = {
                "kind": kind,
                "batch": batch,
                "context": context,
                "error": "".join(traceback.format_exception(exc))[-4000:],
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(
            args.out, {**facts, "heads": args.heads, "block_size": args.block_size, "floors": floors, "cases": rows}
        )


if __name__ == "__main__":
    main()
