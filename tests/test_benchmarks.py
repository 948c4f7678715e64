"""Every benchmark script runs at toy size on the CPU and writes the figures it promises; README's table is current.

Each script runs as its users run it (``python -m benchmarks.X`` from the
repository root, in its own process), with the built-in tiny model's shape and
its GPU-only parts (CUPTI, the shipped GPU kernels, torch's copy and compile)
skipped. The timings mean nothing on a CPU; the tests check that every
figure is there and positive. All scripts start at once and each test waits
for its own, so the module takes about as long as the slowest script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks import report
from benchmarks.harness import request_contexts
from jaxrunner.models.builtin import BUILTIN_MODELS
from jaxrunner.sharding import padded_vocab_size

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600

# Each script's toy command line; "{out}" is its output file (a folder for e2e).
COMMANDS = {
    "decode_step": [
        "--shape",
        "tiny",
        "--batches",
        "2",
        "--contexts",
        "32",
        "--context-spread",
        "0.5",
        "--steps",
        "4",
        "--floor-elements",
        "65536",
        "--loras",
        "2",
        "--lora-rank",
        "4",
        "--out",
        "{out}",
    ],
    "attention_step": [
        "--heads",
        "small",
        "--only",
        "decode:2:64",
        "prefill:1:64",
        "--implementations",
        "reference",
        "--cache-dtype",
        "fp8_e4m3",
        "--repeats",
        "1",
        "--floor-elements",
        "65536",
        "--out",
        "{out}",
    ],
    "matmul_step": [
        "--rows",
        "1",
        "4",
        "--split-k",
        "2",
        "--repeats",
        "1",
        "--projections",
        "qkv",
        "o",
        "--scale",
        "64",
        "--floor-elements",
        "65536",
        "--out",
        "{out}",
    ],
    "fp8_matmul": [
        "--rows",
        "1",
        "4",
        "--repeats",
        "1",
        "--projections",
        "qkv",
        "o",
        "--scale",
        "64",
        "--floor-elements",
        "65536",
        "--out",
        "{out}",
    ],
    "sampler_step": [
        "--shape",
        "tiny",
        "--batch",
        "4",
        "--vocab",
        "512",
        "--context",
        "32",
        "--repeats",
        "3",
        "--out",
        "{out}",
    ],
    "host_work": [
        "--requests",
        "4",
        "--prompt-len",
        "8",
        "--output-len",
        "16",
        "--max-model-len",
        "64",
        "--token-buckets",
        "16",
        "--request-buckets",
        "4",
        "--breakdown",
        "--out",
        "{out}",
    ],
    "hf_peer": [
        "--shape",
        "tiny",
        "--decode",
        "1x32",
        "--workloads",
        "4x16/8",
        "--concurrency",
        "2",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--no-compile",
        "--out",
        "{out}",
    ],
    "e2e": ["--model", "tiny-llama", "--parts", "a", "f", "--out-dir", "{out}"],
    "converted_startup": ["--shape", "tiny", "--quantization", "fp8", "--out", "{out}"],
    "kv_offload": [
        "--model",
        "tiny-llama",
        "--documents",
        "3",
        "--doc-len",
        "96",
        "--question-len",
        "8",
        "--output-len",
        "4",
        "--rounds",
        "2",
        "--gpu-blocks",
        "16",
        "--cpu-blocks",
        "64",
        "--max-num-batched-tokens",
        "128",
        "--out",
        "{out}",
    ],
    "kv_capacity": [
        "--shape",
        "tiny-gemma3",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--cpu-kv-cache-bytes",
        "491520",
        "--out",
        "{out}",
    ],
    "lora_layouts": ["--rows", "1", "4", "--layers", "2", "--scale", "64", "--repeats", "2", "--out", "{out}"],
    "moe_matmul": [
        "--tokens",
        "1",
        "4",
        "--scale",
        "16",
        "--repeats",
        "2",
        "--floor-elements",
        "65536",
        "--out",
        "{out}",
    ],
    "serving": [
        "--num-prompts",
        "6",
        "--input-len",
        "16",
        "--output-len",
        "5",
        "--max-concurrency",
        "4",
        "--offline",
        "--engine-args",
        "--max-model-len 64 --max-num-seqs 4 --max-num-batched-tokens 64 --token-buckets 4 64 --request-buckets 4",
        "--out",
        "{out}",
    ],
    "vl_serving": [
        "--shape",
        "tiny",
        "--num-requests",
        "2",
        "--image-size",
        "56",
        "--output-len",
        "4",
        "--encoder-repeats",
        "2",
        "--out",
        "{out}",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[subprocess.Popen, Path, Path]]]:
    """Every script started at once, on one CPU device: name -> (process, its output, its log)."""
    folder = tmp_path_factory.mktemp("benchmarks")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    started = {}
    for name, args in COMMANDS.items():
        out, log = folder / (name if name == "e2e" else f"{name}.json"), folder / f"{name}.log"
        command = [sys.executable, "-m", f"benchmarks.{name}", *(a.format(out=out) for a in args)]
        with open(log, "w") as sink:
            started[name] = (
                subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT),
                out,
                log,
            )
    yield started
    for process, _, _ in started.values():
        if process.poll() is None:
            process.kill()


def result_of(runs, name: str) -> dict:
    """The JSON the script wrote, once it exited cleanly (its log's tail in the failure otherwise)."""
    process, out, log = runs[name]
    code = process.wait(timeout=TIMEOUT_S)
    assert code == 0, f"benchmarks.{name} exited {code}:\n{log.read_text()[-3000:]}"
    return json.loads((out / "e2e.json" if name == "e2e" else out).read_text())


def assert_stamped(result: dict) -> None:
    assert result["device"] == "cpu" and result["jax"] and result["date"]
    assert "commit" in result


def test_a_cases_contexts_spread_about_its_context_the_same_way_each_time():
    contexts = request_contexts(64, 1000, 0.5)
    assert contexts == request_contexts(64, 1000, 0.5) and len(set(contexts)) > 32
    assert min(contexts) >= 500 and max(contexts) <= 1500 and abs(np.mean(contexts) - 1000) < 100
    assert request_contexts(4, 1000) == [1000] * 4


def test_decode_step_times_each_case_against_its_floor(runs):
    result = result_of(runs, "decode_step")
    assert_stamped(result)
    assert result["copy_bytes_per_s"] > 0 and result["matmul_flops_per_s"] > 0 and "torch_copy_error" in result
    (row,) = result["rows"]
    assert (row["batch"], row["context"], row["context_spread"]) == (2, 32, 0.5)
    assert row["step_ms"] > 0 and row["floor_ms"] > 0 and row["one_at_a_time_ms"] > 0
    assert row["ratio"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    # The roofline floor leaves out the untied embedding table (a step reads its rows) and adds the GEMMs' FLOPs
    # where they bind.
    tiny = BUILTIN_MODELS["tiny-llama"]
    table_gb = padded_vocab_size(tiny.vocab_size, 1) * tiny.hidden_size * 2 / 1e9  # bf16
    assert result["weight_gb"] - result["matmul_weight_gb"] == pytest.approx(table_gb, rel=0.05)  # + norm vectors
    assert 0 < row["roofline_floor_ms"] and row["roofline_ratio"] == pytest.approx(
        row["step_ms"] / row["roofline_floor_ms"]
    )
    # With --loras, the same case on a runner serving two adapters, against the plain runner's step.
    (lora_row,) = result["lora_rows"]
    assert (lora_row["loras"], lora_row["lora_rank"]) == (2, 4) and lora_row["step_ms"] > 0
    assert lora_row["lora_over_base"] == pytest.approx(lora_row["step_ms"] / row["step_ms"])


def test_attention_step_times_the_reference_against_the_floors(runs):
    result = result_of(runs, "attention_step")
    assert_stamped(result)
    assert [(c["kind"], c["batch"], c["context"]) for c in result["cases"]] == [("decode", 2, 64), ("prefill", 1, 64)]
    for case in result["cases"]:
        assert case["cache_dtype"] == "float8_e4m3fn"
        assert case["kv_bytes"] == 2 * case["context"] * case["batch"] * 2 * 64  # FP8: one byte a K or V element
        assert case["flops"] > 0 and case["reference_s"] > 0
        assert case["reference_kv_bw_fraction"] > 0 and case["reference_matmul_fraction"] > 0
        assert "ours_s" not in case and "error" not in case


def test_matmul_step_times_every_projection_and_variant(runs):
    result = result_of(runs, "matmul_step")
    assert_stamped(result)
    rows = {(r["projection"], r["rows"], r["variant"]): r for r in result["rows"]}
    for projection in ("qkv", "o"):
        for m in (1, 4):
            for variant in ("xla", "split_k=2"):
                row = rows[projection, m, variant]
                assert row["timer"] == "wall" and row["kernel_s"] > 0 and row["fraction_of_copy"] > 0
                assert row["max_rel_error"] < 0.05


def test_fp8_matmul_times_each_implementation_against_its_floors(runs):
    result = result_of(runs, "fp8_matmul")
    assert_stamped(result)
    assert result["copy_bytes_per_s"] > 0 and result["fp8_matmul_flops_per_s"] > 0
    rows = result["rows"]
    variants = {f"{impl}{gemm}" for impl in ("w8a8", "weight_only", "bf16") for gemm in ("", "/cublas")}
    assert {(r["projection"], r["rows"], r["variant"]) for r in rows} == {
        (p, m, v) for p in ("qkv", "o") for m in (1, 4) for v in variants
    }
    for row in rows:
        assert row["kernel_s"] > 0 and row["floor_s"] == max(row["copy_floor_s"], row["matmul_floor_s"])
        assert row["over_floor"] == pytest.approx(row["kernel_s"] / row["floor_s"])
        assert row["speedup_over_bf16"] > 0
        # FP8's rounding against the bf16 product (weights only: a few %; inputs too: a few % more).
        assert row["rel_error"] == 0.0 if row["impl"] == "bf16" else 0 < row["rel_error"] < 0.1
        assert isinstance(row.get("reads_fp8_weight", False), bool)
        assert ("reads_fp8_weight" in row) == (row["impl"] == "w8a8")
    fp8 = next(r for r in rows if r["impl"] == "w8a8")
    bf16 = next(r for r in rows if r["impl"] == "bf16" and r["projection"] == fp8["projection"])
    assert fp8["copy_floor_s"] < bf16["copy_floor_s"]  # half the weight bytes


def test_converted_startup_starts_from_safetensors_and_from_the_conversion(runs):
    result = result_of(runs, "converted_startup")
    assert_stamped(result)
    assert result["quantization"] == "fp8" and result["checkpoint_write_s"] > 0
    safetensors, converted = result["safetensors"], result["converted"]
    for start in (result["warm_up"], safetensors, converted):
        assert start["time_to_first_token_s"] >= start["construct_s"] >= start["load_model_s"] > 0
        assert start["programs"] > 0
    assert safetensors["save_converted_s"] > 0 and "save_converted_s" not in converted
    assert converted["first_token_ids"] == safetensors["first_token_ids"]
    assert result["speedup"] == pytest.approx(safetensors["time_to_first_token_s"] / converted["time_to_first_token_s"])


def test_sampler_step_sets_the_sampler_against_the_decode_step(runs):
    result = result_of(runs, "sampler_step")
    assert_stamped(result)
    assert result["decode_step_ms"] > 0 and result["sampler_none_on_ms"] > 0 and result["sampler_all_on_ms"] > 0
    assert result["sampler_all_on_fraction"] == pytest.approx(result["sampler_all_on_ms"] / result["decode_step_ms"])


def test_host_work_breaks_the_step_down_by_span(runs):
    result = result_of(runs, "host_work")
    assert_stamped(result)
    assert result["steps"] > 0 and result["host_ms"] > 0 and result["decode_steps"] > 0
    host, device = result["spans"]["host"], result["spans"]["device"]
    assert {"schedule", "execute_model", "prepare_inputs", "sample_tokens", "get_output", "process_outputs"} <= set(
        host
    )
    assert set(device) == {"program_call", "device_wait"}
    assert all(span["ms_per_step"] > 0 and span["entries_per_step"] > 0 for span in (*host.values(), *device.values()))


def test_hf_peer_runs_decode_and_throughput(runs):
    result = result_of(runs, "hf_peer")
    assert result["device"] == "cpu" and result["compile_requested"] is False
    (workload,) = result["throughput"]
    assert workload["output_tokens"] == 4 * 8 and workload["output_tokens_per_s"] > 0
    (decode,) = result["decode"]
    assert decode["step_ms"] > 0 and decode["compiled"] is False


def test_e2e_measures_floors_and_start_up_phases(runs):
    result = result_of(runs, "e2e")
    assert result["floors"]["copy_bytes_per_s"] > 0 and result["floors"]["device"] == "cpu"
    for start in ("cold", "warm"):
        phases = result["startup"][start]
        assert "error" not in phases
        assert phases["load_model_s"] > 0 and phases["initialize_kv_cache_s"] > 0 and phases["capture_model_s"] > 0
        assert phases["time_to_first_token_s"] > phases["capture_model_s"] and phases["num_compiled_programs"] > 0
    assert result["summary"]["errors"] == []


def test_kv_offload_loads_the_evicted_documents_with_the_same_tokens(runs):
    result = result_of(runs, "kv_offload")
    assert_stamped(result)
    none, offloading = result["runs"]["none"], result["runs"]["offloading"]
    assert result["same_tokens"] and offloading["loaded_tokens"] > 0
    assert offloading["computed_tokens"] == none["computed_tokens"] - offloading["loaded_tokens"]
    assert result["ttft_offloading_over_recompute"] > 0 and result["noop_over_none_wall"] > 0
    # The connector's hooks are timed where it has work: loads and saves with offloading, none without one.
    assert offloading["kv_load_host_s"] > 0 and offloading["kv_save_host_s"] > 0
    assert none["kv_load_host_s"] == none["kv_save_host_s"] == 0
    assert len(offloading["ttft_s"]) == len(none["ttft_s"]) == result["args"]["documents"] * result["args"]["rounds"]


def test_kv_capacity_counts_more_context_with_sliding_window_groups(runs):
    result = result_of(runs, "kv_capacity")
    assert_stamped(result)
    hybrid, full = result["ways"]
    assert (hybrid["kv_cache_groups"], full["kv_cache_groups"]) == (6, 1)
    assert hybrid["kv_cache_gib"] == pytest.approx(full["kv_cache_gib"])  # the same budget: 240 x 1 or 40 x 6 layers
    # Every token takes a slot in each group's blocks: vLLM's token count divides the blocks by the groups.
    assert (hybrid["kv_cache_tokens"], full["kv_cache_tokens"]) == (240 // 6 * 16, 40 * 16)
    # A 256-token request holds 16 one-layer blocks of the full group and 5 (a 32-token window and a
    # 32-token chunk) of each of 5 sliding ones: 41, against 16 six-layer blocks in one group.
    assert hybrid["max_concurrency"] == pytest.approx(239 / 41) and full["max_concurrency"] == pytest.approx(39 / 16)
    assert result["context_tokens_ratio"] > 2


def test_lora_layouts_times_every_way_against_the_plain_step(runs):
    result = result_of(runs, "lora_layouts")
    assert_stamped(result)
    for row in result["rows"]:
        assert row["plain_ms"] > 0
        assert all(row[f"{way}_over_plain"] > 0 for way in ("per_module", "grouped", "grouped_t", "columns"))


def test_moe_matmul_times_every_way_against_the_touched_experts(runs):
    result = result_of(runs, "moe_matmul")
    assert_stamped(result)
    for row in result["rows"]:
        assert 0 < row["experts_touched"] <= min(result["num_experts"], row["tokens"] * result["top_k"])
        assert all(row[f"{way}_ms"] > 0 for way in ("grouped", "per_expert_loop", "gathered"))


def test_serving_streams_every_token_to_every_client_and_compares_offline(runs):
    result = result_of(runs, "serving")
    assert_stamped(result)
    assert result["output_tokens"] == 6 * 5 and result["offline"]["output_tokens_per_s"] > 0
    assert result["served_over_offline"] > 0
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < result[name]["p50"] <= result[name]["p99"]


def test_vl_serving_runs_both_sides_on_images(runs):
    result = result_of(runs, "vl_serving")
    ours, hf = result["ours"], result["hf"]
    assert_stamped(ours)
    assert ours["images_encoded"] == 2 and ours["image_tokens"] == 4 and 0 < ours["encoder_share"]
    assert 0 < ours["ttft_mean_s"] <= ours["wall_s"] and 0 < hf["ttft_s"] and hf["batch_size"] == 2
    assert result["ours_over_hf_output_tokens_per_s"] > 0


def test_readme_table_is_the_one_latest_results_give():
    readme = report.README.read_text()
    assert report.with_table(readme, report.table(report.load_sources())) == readme


def test_table_has_every_figure_from_a_recorded_run():
    rows = report.figures(report.load_sources())
    measured = {label for label, ratio, _, source in rows if source is not None}
    cases = report.DECODE_CASES + report.ATTENTION_DECODE_CASES + report.ATTENTION_FP8_DECODE_CASES
    cases += report.ATTENTION_PREFILL_CASES + report.FP8_WEIGHTS_DECODE_CASES + report.LORA_CASES
    cases += report.FAMILY_DECODE_CASES + list(report.MOE_MATMUL_TOKENS) + list(report.FP8_MATMUL_ROWS)
    assert len(rows) == len(cases) + 10  # + prefill, 4 benches, host share, images, 2 KV connector figures, KV capacity
    # 256 x 4k fits no GPU in bf16.
    assert measured == {label for label, *_ in rows} - {"decode step / bandwidth floor, batch 256 x 4k"}
