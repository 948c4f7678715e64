"""The current figures as one table, from ``benchmarks/results/latest/``, written into ``benchmarks/README.md``.

``results/latest/`` holds the newest recorded run of each measurement and
``sources.json``, which says for each file what it measures (``decode:BxC``,
``attention``, ``attention_fp8``, ``prefill``, ``throughput``, ``host_share``,
``bound:bf16``, ``bound:fp8``, ``bound:fp8w``, ``fp8w:BxC``, ``lora``, ``images``, ``kv_offload``, ``moe_matmul``,
``kv_capacity:gemma3-12b``, ``gemma3-12b:BxC``, ...), where, when,
on which commit and with which command. For each figure the table takes the
last file in ``sources.json`` that measures it, and gives the figure as a
ratio to the floor or peer measured in the same run. To record a new run, copy
its JSON into ``results/latest/``, add its entry at the end of
``sources.json``, and run this script; ``tests/test_benchmarks.py`` checks that
README's table is the one ``results/latest/`` gives.

    python -m benchmarks.report           # rewrite the table in benchmarks/README.md
    python -m benchmarks.report --check   # exit 1 if the README's table is not the one latest/ gives
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from jaxrunner.ops.fp8_matmul import fp8_matmul_impl

HERE = Path(__file__).resolve().parent
LATEST = HERE / "results" / "latest"
README = HERE / "README.md"
BEGIN = "<!-- figures: `python -m benchmarks.report` writes this table from results/latest/; do not edit it -->"
END = "<!-- end of figures -->"

DECODE_CASES = [(batch, context) for context in (1024, 4096) for batch in (1, 16, 64, 256)]
ATTENTION_DECODE_CASES = [(1, 1024), (16, 1024), (64, 1024), (256, 1024), (64, 4096), (256, 4096)]
ATTENTION_FP8_DECODE_CASES = [(64, 4096), (256, 1024)]
ATTENTION_PREFILL_CASES = [(1, 8192), (8, 2048)]
THROUGHPUT_WORKLOAD = "256x1000/1000"
BOUND_WORKLOAD = "1000x1000/1000"
LORA_CASES = [(1, 1024), (64, 1024)]
IMAGES_WORKLOAD = "64 requests x one 1024x1024 image, 128 output tokens"
FP8_WEIGHTS_DECODE_CASES = [(1, 1024), (64, 1024)]
FAMILY_DECODE_CASES = [
    (shape, name, batch, 1024)
    for shape, name in (("gemma3-12b", "Gemma-3-12B"), ("qwen3-30b-a3b", "Qwen3-30B-A3B (MoE)"))
    for batch in (1, 64)
]
MOE_MATMUL_TOKENS = (1, 64)
FP8_MATMUL_ROWS = (1, 64, 8192)


def load_sources(latest: Path = LATEST) -> list[dict]:
    """``sources.json``'s entries, each with its file's JSON under ``data``."""
    sources = json.loads((latest / "sources.json").read_text())
    return [entry | {"data": json.loads((latest / entry["file"]).read_text())} for entry in sources]


def newest(sources: list[dict], measure: str) -> dict | None:
    """The last entry that measures ``measure``."""
    return next((s for s in reversed(sources) if measure in s["measures"]), None)


def size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def decode_figure(source: dict, batch: int, context: int) -> tuple[str, str]:
    """The decode step over its bandwidth floor, and the two times."""
    data = source["data"]
    if source["kind"] == "e2e":
        row = next(r for r in data["summary"]["decode"] if (r["batch"], r["context"]) == (batch, context))
        ratio = row["step_over_floor"]
    else:
        row = next(r for r in data["rows"] if (r["batch"], r["context"]) == (batch, context) and "error" not in r)
        ratio = row["ratio"]
    roofline = f" (roofline {row['roofline_floor_ms']:.2f} ms)" if "roofline_floor_ms" in row else ""
    return f"{ratio:.2f}x", f"{row['step_ms']:.2f} ms a step, floor {row['floor_ms']:.2f} ms{roofline}"


def moe_matmul_figure(source: dict, tokens: int) -> tuple[str, str]:
    """One MoE layer's expert products (the model's grouped path) over the touched experts' copy floor."""
    row = next(r for r in source["data"]["rows"] if r["tokens"] == tokens)
    others = {
        "per_expert_loop": "per-expert loop",
        "gathered": "gathered",
        "grouped_jax_example": "JAX's Mosaic GPU ragged_dot example",
        "grouped_kernel": "our kernel",
    }
    measured = [f"{name} {row[f'{way}_ms']:.3f} ms" for way, name in others.items() if f"{way}_ms" in row]
    return (
        f"{row['grouped_ratio']:.2f}x",
        f"{row['grouped_ms']:.3f} ms, floor {row['floor_ms']:.3f} ms ({row['experts_touched']} experts); "
        + ", ".join(measured),
    )


def fp8_matmul_figure(source: dict, rows: int) -> tuple[str, str]:
    """The 8B's q/k/v projection with FP8 weights at ``rows``: the product its bucket runs
    (``ops/fp8_matmul.py``) over the slower of its copy and matmul floors, beside the other and bf16."""
    impl = fp8_matmul_impl(rows, "dynamic")
    cells = {r["variant"]: r for r in source["data"]["rows"] if r["projection"] == "qkv" and r["rows"] == rows}
    chosen = cells[impl]
    others = ", ".join(f"{v} {cells[v]['kernel_s'] * 1e6:.1f} us" for v in ("w8a8", "weight_only", "bf16") if v != impl)
    return (
        f"{chosen['over_floor']:.2f}x",
        f"{impl} {chosen['kernel_s'] * 1e6:.1f} us, floor {chosen['floor_s'] * 1e6:.1f} us; {others}",
    )


def attention_case(source: dict, kind: str, batch: int, context: int) -> dict:
    return next(r for r in source["data"]["cases"] if (r["kind"], r["batch"], r["context"]) == (kind, batch, context))


def attention_decode_figure(source: dict, batch: int, context: int) -> tuple[str, str]:
    """The kernel's KV read rate over the copy rate (device time of the whole call), and against the shipped kernel."""
    row = attention_case(source, "decode", batch, context)
    vs = row["pallas_paged_attention_device_s"] / row["ours_device_s"]
    return (
        f"{row['ours_device_kv_bw_fraction']:.0%}",
        f"{row['ours_device_s'] * 1e6:.1f} us a call (kernel alone {row['ours_kernel_kv_bw_fraction']:.0%}); "
        f"{vs:.2f}x the shipped Pallas paged_attention",
    )


def attention_fp8_decode_figure(source: dict, batch: int, context: int) -> tuple[str, str]:
    """The kernel's KV read rate over an FP8 cache, counting FP8 bytes, over the copy rate."""
    row = attention_case(source, "decode", batch, context)
    return (
        f"{row['ours_device_kv_bw_fraction']:.0%}",
        f"{row['ours_device_s'] * 1e6:.1f} us a call (kernel alone {row['ours_kernel_kv_bw_fraction']:.0%}), "
        f"{row['kv_bytes'] / 2**20:.0f} MiB of {row['cache_dtype']} KV",
    )


def attention_prefill_figure(source: dict, batch: int, context: int) -> tuple[str, str]:
    """The kernel's causal FLOP rate over the matmul rate, and against the dense FlashAttention-3."""
    row = attention_case(source, "prefill", batch, context)
    vs = row["pallas_attention_mgpu_device_s"] / row["ours_device_s"]
    return (
        f"{row['ours_device_matmul_fraction']:.0%}",
        f"{row['ours_device_s'] * 1e6:.0f} us a call (kernel alone {row['ours_kernel_matmul_fraction']:.0%}); "
        f"{vs:.2f}x the dense FlashAttention-3 (attention_mgpu)",
    )


def lora_figure(source: dict, batch: int, context: int) -> tuple[str, str]:
    """The decode step with requests spread over LoRA adapters, over the plain runner's step in the same run."""
    row = next(r for r in source["data"]["lora_rows"] if (r["batch"], r["context"]) == (batch, context))
    plain = next(r for r in source["data"]["rows"] if (r["batch"], r["context"]) == (batch, context))
    return (
        f"{row['lora_over_base']:.2f}x",
        f"{row['step_ms']:.2f} ms a step against {plain['step_ms']:.2f} ms, "
        f"{row['loras']} adapters of rank {row['lora_rank']} on all seven projections",
    )


def prefill_figure(source: dict) -> tuple[str, str]:
    p = source["data"]["summary"]["prefill"]
    return (
        f"{p['matmul_fraction']:.0%}",
        f"{p['requests']} prompts x {p['input_len']} tokens in {p['elapsed_s']:.1f} s, "
        f"{p['flops_per_s'] / 1e12:.0f} TFLOP/s",
    )


def throughput_figure(source: dict) -> tuple[str, str]:
    row = next(r for r in source["data"]["summary"]["throughput"] if r["workload"] == THROUGHPUT_WORKLOAD)
    return (
        f"{row['ours_over_peer']:.2f}x HF",
        f"{row['ours_tokens_per_s']:,.0f} output tok/s against HF transformers' {row['peer_tokens_per_s']:,.0f}",
    )


def bound_figure(source: dict) -> tuple[str, str]:
    """A ``jaxrunner bench`` run's output rate over its bound (every step's weight and KV bytes at the copy rate),
    and over its roofline bound (each step's FLOPs too) where the run has one."""
    data = source["data"]
    roofline = ""
    if "roofline_bound_fraction" in data:
        roofline = (
            f", roofline {data['roofline_bound_output_tokens_per_s']:,.0f} ({data['roofline_bound_fraction']:.0%})"
        )
    return (
        f"{data['bound_fraction']:.0%}",
        f"{data['output_tokens_per_s']:,.0f} output tok/s, bound {data['bound_output_tokens_per_s']:,.0f}{roofline}; "
        + scheduling(data),
    )


def scheduling(data: dict) -> str:
    """A bench run's preemptions, cache size and largest batch."""
    return (
        f"{data['num_preemptions']} preemptions, {data['kv_cache_tokens']:,} cache tokens, "
        f"at most {data['max_num_scheduled_reqs']} requests a step"
    )


def fp8_over_bf16_figure(source: dict, bf16: dict | None) -> tuple[str, str]:
    """An FP8 bench run's (cache, or weights and cache) output rate over the bf16 run's on the same workload."""
    data = source["data"]
    if bf16 is None:
        return "no bf16 run", f"{data['output_tokens_per_s']:,.0f} output tok/s"
    return (
        f"{data['output_tokens_per_s'] / bf16['data']['output_tokens_per_s']:.2f}x bf16",
        f"{data['output_tokens_per_s']:,.0f} output tok/s ({data['bound_fraction']:.0%} of its bound); "
        + scheduling(data),
    )


def images_figure(source: dict) -> tuple[str, str]:
    """``vl_serving``'s output rate over transformers' on the same GPU, with both times to first token and
    the image encoder's share of the call."""
    ours, hf = source["data"]["ours"], source["data"]["hf"]
    return (
        f"{ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x HF",
        f"{ours['output_tokens_per_s']:,.0f} output tok/s against HF transformers' {hf['output_tokens_per_s']:,.0f}; "
        f"mean time to first token {ours['ttft_mean_s']:.2f} s against {hf['ttft_s']:.2f} s; "
        f"the image encoder {ours['encoder_share']:.0%} of the time",
    )


def kv_offload_figure(source: dict) -> tuple[str, str]:
    """``kv_offload``'s time to first token of documents seen before, loaded from host memory against computed."""
    data = source["data"]
    none, offloading = data["runs"]["none"], data["runs"]["offloading"]
    return (
        f"{data['ttft_offloading_over_recompute']:.2f}x",
        f"{offloading['ttft_later_mean_s'] * 1e3:.0f} ms against {none['ttft_later_mean_s'] * 1e3:.0f} ms; "
        f"{offloading['loaded_tokens']:,} tokens loaded instead of computed",
    )


def kv_capacity_figure(source: dict) -> tuple[str, str]:
    """``kv_capacity``'s context tokens held with the sliding-window KV-cache groups, against one full-length group."""
    data = source["data"]
    hybrid, full = (next(w for w in data["ways"] if w["hybrid"] == h) for h in (True, False))
    return (
        f"{hybrid['context_tokens_held'] / full['context_tokens_held']:.2f}x",
        f"{hybrid['context_tokens_held']:,} against {full['context_tokens_held']:,} context tokens in "
        f"{hybrid['kv_cache_gib']:.1f} GiB of cache; {hybrid['max_concurrency']:.1f} against "
        f"{full['max_concurrency']:.1f} requests of {size(data['max_model_len'])} at once",
    )


def noop_connector_figure(source: dict) -> tuple[str, str]:
    """The whole ``kv_offload`` run with the no-op connector's hooks, against no connector."""
    data = source["data"]
    return (
        f"{data['noop_over_none_wall']:.3f}x",
        f"{data['runs']['noop']['wall_s']:.2f} s against {data['runs']['none']['wall_s']:.2f} s",
    )


def host_share_figure(source: dict) -> tuple[str, str]:
    data = source["data"]
    return (
        f"{data['decode_host_share']:.1%}",
        f"{data['decode_host_ms_per_step']:.2f} ms of a {data['decode_step_ms']:.2f} ms step "
        f"({data['decode_steps']} decode-only steps; {data['output_tokens_per_s']:,.0f} output tok/s)",
    )


def figures(sources: list[dict]) -> list[tuple[str, str, str, dict | None]]:
    """(figure, ratio, what was measured, source) for every row of the table; a figure no file measures
    has ratio "not measured" and no source."""
    wanted: list[tuple[str, str, Callable[[dict], tuple[str, str]]]] = []
    for batch, context in DECODE_CASES:
        wanted.append(
            (
                f"decode step / bandwidth floor, batch {batch} x {size(context)}",
                f"decode:{batch}x{context}",
                lambda s, b=batch, c=context: decode_figure(s, b, c),
            )
        )
    for batch, context in ATTENTION_DECODE_CASES:
        wanted.append(
            (
                f"attention kernel, decode {batch} x {size(context)}: KV read / copy rate",
                "attention",
                lambda s, b=batch, c=context: attention_decode_figure(s, b, c),
            )
        )
    for batch, context in ATTENTION_FP8_DECODE_CASES:
        wanted.append(
            (
                f"attention kernel, decode {batch} x {size(context)} over an FP8 cache: KV read / copy rate",
                "attention_fp8",
                lambda s, b=batch, c=context: attention_fp8_decode_figure(s, b, c),
            )
        )
    for batch, context in ATTENTION_PREFILL_CASES:
        wanted.append(
            (
                f"attention kernel, prefill {batch} x {size(context)}: FLOP/s / matmul rate",
                "attention",
                lambda s, b=batch, c=context: attention_prefill_figure(s, b, c),
            )
        )
    for batch, context in FP8_WEIGHTS_DECODE_CASES:
        wanted.append(
            (
                f"decode step with FP8 weights and KV cache / bandwidth floor, batch {batch} x {size(context)}",
                f"fp8w:{batch}x{context}",
                lambda s, b=batch, c=context: decode_figure(s, b, c),
            )
        )
    for batch, context in LORA_CASES:
        wanted.append(
            (
                f"LoRA decode step / plain decode step, batch {batch} x {size(context)}",
                "lora",
                lambda s, b=batch, c=context: lora_figure(s, b, c),
            )
        )
    wanted += [
        ("prefill, whole model (`jaxrunner bench`, output length 1): FLOP/s / matmul rate", "prefill", prefill_figure),
        (f"offline throughput {THROUGHPUT_WORKLOAD}: output tok/s / HF transformers'", "throughput", throughput_figure),
        ("host work / decode step, batch 64 (`jaxrunner bench` 64 x 1000/256)", "host_share", host_share_figure),
        (f"offline throughput {BOUND_WORKLOAD}, bf16 cache: output tok/s / bound", "bound:bf16", bound_figure),
        (
            f"offline throughput {BOUND_WORKLOAD}, FP8 cache: output tok/s / bf16 cache's",
            "bound:fp8",
            lambda s: fp8_over_bf16_figure(s, newest(sources, "bound:bf16")),
        ),
        (
            f"offline throughput {BOUND_WORKLOAD}, FP8 weights and cache: output tok/s / bf16's",
            "bound:fp8w",
            lambda s: fp8_over_bf16_figure(s, newest(sources, "bound:bf16")),
        ),
        (
            f"Qwen2.5-VL-7B shape, {IMAGES_WORKLOAD}: output tok/s / HF transformers'",
            "images",
            images_figure,
        ),
        (
            "KV offloading to host memory, multi-turn documents past the device's cache: time to first token / "
            "recomputing",
            "kv_offload",
            kv_offload_figure,
        ),
        ("KV connector hooks (no-op connector) / none, the same run", "kv_offload", noop_connector_figure),
    ]
    wanted.append(
        (
            "Gemma-3-12B shape KV cache at `gpu_memory_utilization=0.9`: context tokens held, sliding-window "
            "groups / one full-length group",
            "kv_capacity:gemma3-12b",
            kv_capacity_figure,
        )
    )
    for shape, name, batch, context in FAMILY_DECODE_CASES:
        wanted.append(
            (
                f"{name} shape decode step / bandwidth floor, batch {batch} x {size(context)}",
                f"{shape}:{batch}x{context}",
                lambda s, b=batch, c=context: decode_figure(s, b, c),
            )
        )
    for rows in FP8_MATMUL_ROWS:
        wanted.append(
            (
                f"Llama-3-8B q/k/v projection with FP8 weights, {rows} row{'s' if rows > 1 else ''}: time / floor",
                "fp8_matmul",
                lambda s, r=rows: fp8_matmul_figure(s, r),
            )
        )
    for tokens in MOE_MATMUL_TOKENS:
        wanted.append(
            (
                f"Qwen3-30B-A3B MoE layer's experts, {tokens} token{'s' if tokens > 1 else ''}: time / touched "
                "experts' bytes at the copy rate",
                "moe_matmul",
                lambda s, t=tokens: moe_matmul_figure(s, t),
            )
        )
    rows = []
    for label, measure, figure in wanted:
        source = newest(sources, measure)
        if source is None:
            rows.append((label, "not measured", "", None))
        else:
            rows.append((label, *figure(source), source))
    return rows


def device_name(device: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``."""
    return device.removeprefix("NVIDIA ").split()[0]


def table(sources: list[dict]) -> str:
    """The Markdown table of every figure, then its sources: device, JAX, date, commit and command."""
    rows = figures(sources)
    used = list(dict.fromkeys(s["file"] for *_, s in rows if s is not None))
    by_file = {s["file"]: s for s in sources}
    lines = ["| figure | ratio | measured | on | source |", "|---|---:|---|---|---|"]
    for label, ratio, measured, source in rows:
        on = f"{device_name(source['device'])}, {source['date']}" if source else ""
        ref = f"[{used.index(source['file']) + 1}]" if source else ""
        lines.append(f"| {label} | {ratio} | {measured} | {on} | {ref} |")
    lines += ["", "Sources (raw JSON in `results/latest/`):", ""]
    for i, name in enumerate(used, 1):
        s = by_file[name]
        commit = f"commit {s['commit']}" if s.get("commit") else f"recorded in commit {s['recorded_in']}"
        note = f"; {s['note']}" if s.get("note") else ""
        lines.append(
            f"{i}. {s['device']}, jax {s['jax']}, {s['date']}, {commit}: `{s['command']}` "
            f"([{name}](results/latest/{name}){note})"
        )
    return "\n".join(lines)


def with_table(readme: str, generated: str) -> str:
    """``readme`` with the text between its markers replaced by ``generated``."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return f"{readme[:start]}\n{generated}\n{readme[end:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that README's table is up to date")
    args = parser.parse_args()
    readme = README.read_text()
    updated = with_table(readme, table(load_sources()))
    if args.check:
        if updated != readme:
            sys.exit(
                "benchmarks/README.md's table is not the one results/latest/ gives: run python -m benchmarks.report"
            )
        return
    README.write_text(updated)


if __name__ == "__main__":
    main()
