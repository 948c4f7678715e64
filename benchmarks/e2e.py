"""End-to-end speed on one GPU: floors, decode steps, prefill, offline throughput, the HF peer, start-up.

Each part runs in subprocesses of the real entry points, one after another, so
that each gets the whole GPU and a fresh process (JAX and torch never share the
device's memory), and a failing or hung subprocess (``--timeout`` each) is
recorded in the JSON while the rest still run:

  a  floors: copy bandwidth (JAX's and torch's copy; the faster is the floor) and
     the bf16 matmul rate (``benchmarks.harness.measure_floors``)
  b  decode step (``benchmarks.decode_step``, pipelined as the engine runs it) at each
     batch x context over its floor, (weights + KV bytes) / copy bandwidth
  c  prefill throughput (``jaxrunner bench``, output length 1) as a fraction of
     the matmul floor: the prompts' matmul and causal-attention FLOPs / time
  d  offline throughput (``jaxrunner bench``) on each workload, and the shares
     of a step's wall time spent in the engine's host work and inside the calls
     of the compiled programs
  e  the same model and workloads through HuggingFace transformers on PyTorch
     (``benchmarks.hf_peer``), as our / peer ratios
  f  start-up to the first token (``LLM(...)`` and a one-token ``generate``) with
     an empty compilation cache (cold), then with the cache it filled (warm); the
     seconds of each start-up phase from the engine's spans (``load_model``,
     ``profile_run``, ``initialize_kv_cache``, ``capture_model``)

Every figure in the table is a ratio to a floor or to the peer measured in the
same run (without part a, parts b and c use the floors that decode_step
measured). Parts run in the order given; each subprocess gets at most
``--timeout`` seconds and what is left of ``--budget``, so a call ends in time
and keeps what it measured. Writes ``e2e.json`` (rewritten after each part),
``e2e.log`` (every subprocess's output) and ``decode_vs_floor.png`` into
``--out-dir``, and prints the table last.

On the H200, with the project installed (``pip install --no-deps -e .``), from
the repository root, in two calls of about 9 minutes each (a ratio needs its
two sides in one call):

    python -m benchmarks.e2e --parts a b c d e --workloads 1000x128/128 64x1000/256 --peer-max-batches 3 \
        --peer-decode 1x1024 --budget 560 --out-dir $OUT
    python -m benchmarks.e2e --parts d e f --workloads 256x1000/1000 --peer-decode --budget 570 --out-dir $OUT

Estimated seconds, from the history's load and compile times and a trial of
hf_peer on the H200. Call 1, about 535: a 20; b 140 (two decode_step
runs, each 22 s of random init and 15-40 s of compiling; 6 and 1 cases); c 105
(the call's first bench: ~95 s of start-up with cold compiles, then 256k prompt
tokens); d 100 (two benches, compiles cached by c; 64 x 1000/256 gives the host
share at batch 64); e 170 (15 s to start, 30 s to compile and warm up, three
batches of 4.8 s, one batch of 64, then the decode case 1x1024, a recompile of
35-60 s). Call 2, about 550: d 185 (cold start-up, 1000 steps
of ~85 ms); e 215 (15 s to start, ~35 s to compile, 1000 steps of 0.159 s); f
150 (cold ~110, warm ~40; last, so the budget cuts it first). Measured on
2026-12-04: a 15, b 166 (131 + 35), d 105 for 256 x 1000/1000 (steps of ~30 ms
by then), e 223, f 145 (cold 119, warm 26); parts a b d e in one call took 531 s.

On a CPU, every part at toy sizes in a few minutes (the test suite runs some of them):

    python -m benchmarks.e2e --model tiny-llama --out-dir /tmp/e2e
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the harness imports JAX, which the start-up worker times: imported where needed
    from jaxrunner.models import TransformerConfig

REPO = Path(__file__).resolve().parent.parent  # subprocesses run from here: `python -m benchmarks.X` finds this package
PARTS = "abcdef"
MIN_SUBPROCESS_S = 30  # a subprocess that would get less than this of the budget is not started


@dataclasses.dataclass(frozen=True)
class Preset:
    """What one model is measured at: the engine settings and the sizes of each part."""

    shape: str  # the model's shape in benchmarks.harness.SHAPES
    engine: dict  # LLM keyword arguments, also given to `jaxrunner bench` as flags
    decode: list[tuple[int, int]]  # batch x context
    peer_decode: list[tuple[int, int]]
    workloads: list[tuple[int, int, int]]  # requests x input / output length
    prefill: tuple[int, int]  # requests x input length
    floor_elements: int  # bf16 elements of the copy that measures the bandwidth floor
    decode_steps: int
    peer_max_batches: int = 0  # run only the peer's first k batches of each workload (0: all)


PRESETS = {
    # The bench settings of the recorded runs. 256 x 4096 is left out: its KV cache alone (137 GB) does not fit.
    "random-llama3-8b": Preset(
        shape="llama3-8b",
        engine=dict(
            max_model_len=2048,
            max_num_seqs=256,
            token_buckets=[256, 1024, 2048, 4096, 8192],
            request_buckets=[16, 64, 256],
        ),
        decode=[(1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024), (64, 4096), (256, 1024)],
        peer_decode=[(1, 1024), (64, 4096)],
        workloads=[(256, 1000, 1000), (1000, 128, 128)],
        prefill=(256, 1000),
        floor_elements=1 << 30,
        decode_steps=30,
    ),
    # Toy sizes, few programs to compile, that run every part on a CPU in minutes: to check this script.
    "tiny-llama": Preset(
        shape="tiny",
        engine=dict(
            max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64], request_buckets=[4]
        ),
        decode=[(1, 64), (4, 64)],
        peer_decode=[(1, 64)],
        workloads=[(8, 32, 16)],
        prefill=(4, 32),
        floor_elements=1 << 16,
        decode_steps=4,
    ),
}


# ----------------------------------------------------------------- subprocesses


@dataclasses.dataclass
class Harness:
    """Runs the parts' subprocesses: their output into one log, their JSON into a scratch folder."""

    model: str
    preset: Preset
    scratch: Path
    log: Path
    timeout: float  # seconds one subprocess may run
    deadline: float  # time.monotonic() by which every subprocess must have ended

    def run(self, label: str, command: list[str]) -> str | None:
        """Run ``command`` to its end or its timeout; returns None, or what went wrong with the output's tail."""
        left = self.deadline - time.monotonic()
        timeout = min(self.timeout, left)
        if left < MIN_SUBPROCESS_S:
            print(f"[{label}] skipped: the run's --budget is spent", flush=True)
            return "skipped: the run's --budget is spent"
        print(f"[{label}] {' '.join(command)}", flush=True)
        start = time.perf_counter()
        with open(self.log, "a") as log:
            log.write(f"\n===== [{label}] {' '.join(command)}\n")
            log.flush()
            offset = log.tell()
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the child and whatever it started
                proc.wait()
                code = None
        elapsed = time.perf_counter() - start
        if code == 0:
            print(f"[{label}] done in {elapsed:.0f} s", flush=True)
            return None
        error = f"timed out after {timeout:.0f} s" if code is None else f"exit status {code}"
        with open(self.log) as log:
            log.seek(offset)
            tail = log.read()[-1500:]
        print(f"[{label}] {error}; its output ends:\n{tail}", flush=True)
        last_line = next((line for line in reversed(tail.replace("\r", "\n").splitlines()) if line.strip()), "")
        return f"{error}: {last_line}\n{tail}"

    def run_json(self, label: str, command: Callable[[Path], list[str]]) -> dict:
        """Run the command that ``command(path)`` builds and read the JSON it writes to ``path``.

        A failed command's error is added to whatever JSON it wrote before failing (hf_peer
        writes after each measurement), so that a run cut short keeps what it measured.
        """
        path = self.scratch / f"{label}.json"
        error = self.run(label, command(path))
        result = json.loads(path.read_text()) if path.exists() else {}
        if error or not result:
            result["error"] = error or "it wrote no JSON"
        return result

    def worker(self, label: str, name: str, *extra: str) -> dict:
        """This script's own ``worker`` mode, for measurements that have no entry point of their own."""
        return self.run_json(
            label,
            lambda out: [
                sys.executable,
                "-m",
                "benchmarks.e2e",
                "worker",
                name,
                "--model",
                self.model,
                "--out",
                str(out),
                *extra,
            ],
        )


def engine_flags(engine: dict) -> list[str]:
    """LLM keyword arguments as `jaxrunner bench` flags."""
    flags = []
    for name, value in engine.items():
        flags += ["--" + name.replace("_", "-"), *map(str, value if isinstance(value, list) else [value])]
    return flags


def bench(h: Harness, label: str, requests: int, input_len: int, output_len: int) -> dict:
    """One `jaxrunner bench` run: its JSON."""
    return h.run_json(
        label,
        lambda out: [
            sys.executable,
            "-P",
            "-m",
            "jaxrunner",
            "bench",
            "--model",
            h.model,
            "--quiet",
            *engine_flags(h.preset.engine),
            "--num-prompts",
            str(requests),
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--output-json",
            str(out),
        ],
    )


# ------------------------------------------------------------------------ parts


def part_floors(h: Harness) -> dict:
    return h.worker("a_floors", "floors")


def decode_grids(cases: list[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """The cases as the fewest batch x context grids of the same shape as decode_step takes.

    Batches that share the same contexts share a grid: decode_step sizes its KV cache
    for its largest batch at its longest context, so one grid of every case would not fit.
    """
    contexts: dict[int, set[int]] = {}
    for batch, context in cases:
        contexts.setdefault(batch, set()).add(context)
    grids: dict[tuple[int, ...], list[int]] = {}
    for batch, ctxs in sorted(contexts.items()):
        grids.setdefault(tuple(sorted(ctxs)), []).append(batch)
    return [(batches, list(ctxs)) for ctxs, batches in grids.items()]


def part_decode(h: Harness) -> dict:
    runs = []
    for batches, contexts in decode_grids(h.preset.decode):
        label = f"b_decode_{'-'.join(map(str, batches))}x{'-'.join(map(str, contexts))}"
        runs.append(
            h.run_json(
                label,
                lambda out, batches=batches, contexts=contexts: [
                    sys.executable,
                    "-m",
                    "benchmarks.decode_step",
                    "--shape",
                    h.preset.shape,
                    "--batches",
                    *map(str, batches),
                    "--contexts",
                    *map(str, contexts),
                    "--steps",
                    str(h.preset.decode_steps),
                    "--floor-elements",
                    str(h.preset.floor_elements),
                    "--out",
                    str(out),
                ],
            )
        )
    return {"runs": runs}


def part_prefill(h: Harness) -> dict:
    requests, input_len = h.preset.prefill
    return bench(h, f"c_prefill_{requests}x{input_len}", requests, input_len, 1)


def workload_name(requests: int, input_len: int, output_len: int) -> str:
    return f"{requests}x{input_len}/{output_len}"


def part_throughput(h: Harness) -> dict:
    return {
        workload_name(*w): bench(h, f"d_bench_{workload_name(*w).replace('/', '-')}", *w) for w in h.preset.workloads
    }


def part_peer(h: Harness) -> dict:
    def command(out: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.hf_peer",
            "--shape",
            h.preset.shape,
            "--decode",
            *(f"{b}x{c}" for b, c in h.preset.peer_decode),
            "--workloads",
            *(workload_name(*w) for w in h.preset.workloads),
            "--concurrency",
            str(h.preset.engine["max_num_seqs"]),
            "--max-batches",
            str(h.preset.peer_max_batches),
            "--out",
            str(out),
        ]

    return h.run_json("e_hf_peer", command)


def part_startup(h: Harness) -> dict:
    """Cold: an empty compilation cache folder; warm: the same folder again, as the first run left it."""
    cache_dir = tempfile.mkdtemp(prefix="e2e-xla-cache-")
    try:
        return {
            start: h.worker(f"f_startup_{start}", "startup", "--cache-dir", cache_dir) for start in ("cold", "warm")
        }
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


PART_FUNCTIONS: dict[str, tuple[str, Callable[[Harness], dict]]] = {
    "a": ("floors", part_floors),
    "b": ("decode", part_decode),
    "c": ("prefill", part_prefill),
    "d": ("throughput", part_throughput),
    "e": ("peer", part_peer),
    "f": ("startup", part_startup),
}


# ---------------------------------------------------------------------- workers


def floors_worker(args: argparse.Namespace) -> dict:
    """The harness's floors (JAX's and torch's copy, the matmul), with the device they were measured on."""
    from benchmarks.harness import device_facts, measure_floors

    return measure_floors(PRESETS[args.model].floor_elements) | device_facts()


# The runner's start-up spans: loading the weights, the profile run that sizes the KV cache (inside its
# allocation, counted apart), allocating the cache, and compiling every bucket.
STARTUP_SPANS = ("load_model", "profile_run", "initialize_kv_cache", "capture_model")


def startup_worker(args: argparse.Namespace) -> dict:
    """Import, build the engine, and generate one token; the seconds of each phase and the programs compiled."""
    start = time.perf_counter()
    from jaxrunner import LLM, SamplingParams
    from jaxrunner.runner.compilation import CompileCounter

    imported = time.perf_counter()
    llm = LLM(args.model, compilation_cache_dir=args.cache_dir, **PRESETS[args.model].engine)
    built = time.perf_counter()
    phases = {f"{name}_s": llm.llm_engine.spans.seconds.get(name, 0.0) for name in STARTUP_SPANS}
    programs_built = CompileCounter.count()
    output = llm.generate("Hello, my name is", SamplingParams(max_tokens=1), use_tqdm=False)[0]
    first_token = time.perf_counter()
    compiling = phases["profile_run_s"] + phases["initialize_kv_cache_s"] + phases["capture_model_s"]
    return {
        "import_s": imported - start,
        "construct_s": built - imported,
        "first_generate_s": first_token - built,
        "time_to_first_token_s": first_token - imported,
        **phases,
        # The rest of the constructor: weights (random init or checkpoint), tokenizer, runner set-up.
        "load_s": built - imported - compiling,
        "num_compiled_programs": llm.llm_engine.runner.num_compiled_programs,
        "xla_programs_built": CompileCounter.count(),
        "xla_programs_built_by_first_generate": CompileCounter.count() - programs_built,
        "first_token_ids": list(output.outputs[0].token_ids),
        "cache_dir_files": sum(len(files) for _, _, files in os.walk(args.cache_dir)),
    }


WORKERS = {"floors": floors_worker, "startup": startup_worker}


def worker_main(argv: list[str]) -> None:
    """``e2e.py worker NAME --model M --out F [--cache-dir D]``: one measurement in this process, as JSON."""
    parser = argparse.ArgumentParser(prog="e2e.py worker")
    parser.add_argument("name", choices=sorted(WORKERS))
    parser.add_argument("--model", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    result = WORKERS[args.name](args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


# -------------------------------------------------------------------- reporting

# Targets of the issue "End-to-end speed on the H200", for the Llama-3-8B shape.
DECODE_TARGET = 1.25  # decode step / bandwidth floor, at batch 1 and 64
DECODE_TARGET_BATCHES = (1, 64)
PEER_TARGET = 3.0  # our / HF output tokens per second
PEER_TARGET_WORKLOAD = "256x1000/1000"
WARM_START_TARGET_S = 30.0
HOST_SHARE_TARGET = 0.15  # engine host time per step / wall time per step, at batch 64
HOST_SHARE_TARGET_BATCH = 64


def ok(value: dict) -> bool:
    return bool(value) and "error" not in value


def floors_of(results: dict) -> dict | None:
    """Part a's floors, else those the first decode_step run measured (in this run too)."""
    candidates = [results.get("floors")] + results.get("decode", {}).get("runs", [])
    return next((c for c in candidates if c and ok(c)), None)


def decode_rows(results: dict, floors: dict) -> list[dict]:
    """Every decode case: our step over its floor at ``floors``' copy rate, and the peer's step over ours."""
    peer = {(r["batch"], r["context"]): r["step_ms"] for r in results.get("peer", {}).get("decode", []) if ok(r)}
    rows = []
    for run in filter(ok, results.get("decode", {}).get("runs", [])):
        for r in run["rows"]:
            moved = r["floor_ms"] / 1e3 * run["copy_bytes_per_s"]  # the bytes decode_step counted
            floor_ms = moved / floors["copy_bytes_per_s"] * 1e3
            row = {
                "batch": r["batch"],
                "context": r["context"],
                "step_ms": r["step_ms"],
                "floor_ms": floor_ms,
                "step_over_floor": r["step_ms"] / floor_ms,
            }
            if (r["batch"], r["context"]) in peer:
                row["peer_step_ms"] = peer[r["batch"], r["context"]]
                row["peer_over_ours"] = row["peer_step_ms"] / r["step_ms"]
            rows.append(row)
    return sorted(rows, key=lambda row: (row["context"], row["batch"]))


def prefill_flops(shape: TransformerConfig, input_len: int) -> float:
    """FLOPs of one prompt's prefill: the layers' matmuls, causal attention, and the last token's logits."""
    hidden, layers = shape.hidden_size, shape.num_layers
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    weights_per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * shape.intermediate_size  # q o k v, gate up down
    attention = layers * 2 * q * input_len * (input_len + 1)  # QK and PV: 4 * q FLOPs per visible (query, key) pair
    return 2 * layers * weights_per_layer * input_len + attention + 2 * hidden * shape.vocab_size


def prefill_summary(results: dict, preset: Preset, floors: dict) -> dict:
    from benchmarks.harness import SHAPES

    requests, input_len = preset.prefill
    flops = requests * prefill_flops(SHAPES[preset.shape], input_len)
    rate = flops / results["prefill"]["elapsed_s"]
    return {
        "requests": requests,
        "input_len": input_len,
        "elapsed_s": results["prefill"]["elapsed_s"],
        "flops": flops,
        "flops_per_s": rate,
        "matmul_fraction": rate / floors["matmul_flops_per_s"],
    }


def throughput_rows(results: dict) -> list[dict]:
    """Each workload: our and the peer's output tokens per second, and their ratio."""
    peer = {
        workload_name(r["num_prompts"], r["input_len"], r["output_len"]): r
        for r in results.get("peer", {}).get("throughput", [])
        if ok(r)
    }
    ours_all = results.get("throughput", {})
    rows = []
    for name in dict.fromkeys([*ours_all, *peer]):
        ours = ours_all.get(name, {})
        row = {"workload": name, "ours_tokens_per_s": ours.get("output_tokens_per_s")}
        if ok(ours) and ours.get("num_steps"):
            # The engine's host work (scheduling, input packing, output handling) and the time inside the
            # compiled programs' calls (XLA launching kernels on this thread), each over the wall time of a
            # step; the host share over decode-only steps where the bench reports them (the issue's "host
            # time per decode step"). The batch is the largest one step ran.
            step_ms = ours["elapsed_s"] / ours["num_steps"] * 1e3
            row |= {
                "step_ms": step_ms,
                "host_ms_per_step": ours["host_ms_per_step"],
                "host_share": ours.get("decode_host_share", ours["host_ms_per_step"] / step_ms),
                "call_share": ours["program_call_ms_per_step"] / step_ms,
                "max_batch": ours["max_num_scheduled_reqs"],
            }
        if name in peer:
            row |= {
                "peer_tokens_per_s": peer[name]["output_tokens_per_s"],
                "peer_requests_run": peer[name]["requests_run"],
                "peer_subset": peer[name]["subset"],
            }
            if ok(ours):
                row["ours_over_peer"] = ours["output_tokens_per_s"] / row["peer_tokens_per_s"]
        rows.append(row)
    return rows


def targets(summary: dict) -> list[str]:
    """The issue's targets against what this run measured."""
    lines = []
    decode = [r for r in summary.get("decode", []) if r["batch"] in DECODE_TARGET_BATCHES]
    if decode:
        lines.append(
            f"decode step <= {DECODE_TARGET}x floor at batch 1 and 64: "
            + ", ".join(
                f"{r['batch']}x{r['context']} {r['step_over_floor']:.2f}"
                f"{'' if r['step_over_floor'] <= DECODE_TARGET else ' (missed)'}"
                for r in decode
            )
        )
    peer = next(
        (r for r in summary.get("throughput", []) if r["workload"] == PEER_TARGET_WORKLOAD and "ours_over_peer" in r),
        None,
    )
    if peer:
        lines.append(
            f">= {PEER_TARGET:.0f}x HF output tok/s at {PEER_TARGET_WORKLOAD}: {peer['ours_over_peer']:.2f}x"
            f"{'' if peer['ours_over_peer'] >= PEER_TARGET else ' (missed)'}"
        )
    for r in summary.get("throughput", []):
        if r.get("max_batch") == HOST_SHARE_TARGET_BATCH:
            lines.append(
                f"host time < {HOST_SHARE_TARGET:.0%} of the step at batch {HOST_SHARE_TARGET_BATCH} "
                f"({r['workload']}): {r['host_share']:.1%}"
                f"{'' if r['host_share'] < HOST_SHARE_TARGET else ' (missed)'}"
            )
    warm = summary.get("startup", {}).get("warm")
    if warm:
        seconds = warm["time_to_first_token_s"]
        lines.append(
            f"warm start-up to first token < {WARM_START_TARGET_S:.0f} s: {seconds:.1f} s"
            f"{'' if seconds < WARM_START_TARGET_S else ' (missed)'}"
        )
    return lines


def errors(value, where: str = "") -> list[str]:
    """Every ``error`` recorded anywhere in the results, with where it was, first line only."""
    if isinstance(value, dict):
        found = [f"{where}: {str(value['error']).strip().splitlines()[0][:160]}"] if "error" in value else []
        return found + [e for k, v in value.items() if k != "error" for e in errors(v, f"{where}.{k}".strip("."))]
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in errors(v, f"{where}[{i}]")]
    return []


def summarize(results: dict, preset: Preset) -> dict:
    """The ratios the table shows, from whatever parts ran without error."""
    floors = floors_of(results)
    summary: dict = {"floors": floors, "errors": errors({k: v for k, v in results.items() if k != "summary"})}
    if floors:
        summary["decode"] = decode_rows(results, floors)
        if ok(results.get("prefill", {})):
            summary["prefill"] = prefill_summary(results, preset, floors)
    summary["throughput"] = throughput_rows(results)
    summary["startup"] = {k: v for k, v in results.get("startup", {}).items() if ok(v)}
    summary["targets"] = targets(summary)
    return summary


def guarded_summary(results: dict, preset: Preset) -> dict:
    """The summary, or the error that a measurement of an unexpected form caused; the raw results stay either way."""
    try:
        return summarize(results, preset)
    except Exception as exc:
        return {"errors": [f"summary: {exc!r}"]}


def floor_lines(floors: dict) -> list[str]:
    copies = ", ".join(
        f"{name} {floors[f'{name}_copy_bytes_per_s'] / 1e12:.2f}"
        for name in ("jax", "torch")
        if f"{name}_copy_bytes_per_s" in floors
    )
    return [
        f"(a) floors: copy {floors['copy_bytes_per_s'] / 1e12:.2f} TB/s ({copies or 'one copy'}), "
        f"bf16 matmul {floors['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
    ]


def decode_lines(rows: list[dict]) -> list[str]:
    lines = [
        "(b) decode step: ours / floor [(weights + KV) / copy]; HF / ours",
        f"    {'batch':>5} {'context':>7} {'ours ms':>8} {'floor ms':>8} {'ours/floor':>10} {'HF ms':>8} "
        f"{'HF/ours':>7}",
    ]
    for r in rows:
        peer = f"{r['peer_step_ms']:>8.2f} {r['peer_over_ours']:>7.2f}" if "peer_step_ms" in r else ""
        lines.append(
            f"    {r['batch']:>5} {r['context']:>7} {r['step_ms']:>8.2f} {r['floor_ms']:>8.2f} "
            f"{r['step_over_floor']:>10.2f} {peer}"
        )
    return lines


def prefill_lines(p: dict) -> list[str]:
    return [
        f"(c) prefill {p['requests']} x {p['input_len']} tokens in {p['elapsed_s']:.1f} s: "
        f"{p['flops_per_s'] / 1e12:.0f} TFLOP/s = {p['matmul_fraction']:.2f} of the matmul floor"
    ]


def throughput_lines(rows: list[dict]) -> list[str]:
    lines = [
        "(d, e) offline output tok/s: ours, HF transformers, ours / HF; per step of ours, the share of the",
        "       engine's host work and of the calls into the compiled programs",
        f"    {'workload':>15} {'ours':>8} {'host %':>6} {'calls %':>7} {'HF':>8} {'ours/HF':>7}  HF requests run",
    ]
    for r in rows:
        ours = f"{r['ours_tokens_per_s']:>8.0f}" if r["ours_tokens_per_s"] else f"{'-':>8}"
        ours += f" {r['host_share']:>6.1%} {r['call_share']:>7.1%}" if "host_share" in r else f" {'-':>6} {'-':>7}"
        ratio = f"{r['ours_over_peer']:>7.2f}" if "ours_over_peer" in r else f"{'-':>7}"
        subset = " (a subset)" if r.get("peer_subset") else ""
        peer = (
            f"{r['peer_tokens_per_s']:>8.0f} {ratio}  {r['peer_requests_run']}{subset}"
            if r.get("peer_tokens_per_s")
            else ""
        )
        lines.append(f"    {r['workload']:>15} {ours} {peer}")
    return lines


def startup_lines(startup: dict) -> list[str]:
    lines = [
        "(f) start-up: LLM(...) to the first token",
        f"    {'':>5} {'total s':>8} {'load s':>7} {'KV init s':>9} {'precompile s':>12} {'programs':>8} "
        f"{'compiled by 1st generate':>24}",
    ]
    for start, s in startup.items():
        lines.append(
            f"    {start:>5} {s['time_to_first_token_s']:>8.1f} {s['load_s']:>7.1f} "
            f"{s.get('profile_run_s', 0) + s.get('initialize_kv_cache_s', 0):>9.1f} "
            f"{s.get('capture_model_s', 0):>12.1f} "
            f"{s['num_compiled_programs']:>8} {s['xla_programs_built_by_first_generate']:>24}"
        )
    if {"cold", "warm"} <= startup.keys():
        cold, warm = (startup[k]["time_to_first_token_s"] for k in ("cold", "warm"))
        lines.append(f"    warm / cold: {warm / cold:.2f}")
    return lines


def table(results: dict) -> list[str]:
    """The short table: each section that has figures, then the targets and the errors."""
    summary, meta = results["summary"], results["meta"]
    lines = [f"===== e2e: {meta['model']} on {meta['device'] or '?'}, {meta['date']}, parts {meta['parts']}"]
    if summary.get("floors"):
        lines += floor_lines(summary["floors"])
    if summary.get("decode"):
        lines += decode_lines(summary["decode"])
    if summary.get("prefill"):
        lines += prefill_lines(summary["prefill"])
    if summary.get("throughput"):
        lines += throughput_lines(summary["throughput"])
    if summary.get("startup"):
        lines += startup_lines(summary["startup"])
    lines += [f"target: {t}" for t in summary.get("targets", [])]
    lines += [f"error: {e}" for e in summary.get("errors", [])]
    return lines


def plot_decode(rows: list[dict], path: Path) -> None:
    """Step time against batch, one panel per context: ours, the bandwidth floor, and the HF peer where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        panel = [r for r in rows if r["context"] == context]
        batches = [r["batch"] for r in panel]
        ax.plot(batches, [r["step_ms"] for r in panel], "o-", label="jaxrunner decode step")
        ax.plot(batches, [r["floor_ms"] for r in panel], "k--", label="floor: (weights + KV) / copy bandwidth")
        peer = [(r["batch"], r["peer_step_ms"]) for r in panel if "peer_step_ms" in r]
        if peer:
            ax.plot(*zip(*peer), "s:", label="HF transformers decode step")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set(xlabel="batch", ylabel="ms per step", title=f"context {context}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    # Imported here, not at the top, so that the start-up worker times the import of JAX and jaxrunner.
    from benchmarks.harness import parse_pair, parse_workload

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="run in this order")
    parser.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default="random-llama3-8b",
        help="the built-in model; its preset sets every size below",
    )
    parser.add_argument("--out-dir", default="e2e")
    parser.add_argument("--timeout", type=float, default=420, help="seconds each subprocess may run")
    parser.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds the whole run may take: a subprocess gets at most what is left of it",
    )
    parser.add_argument("--decode", type=parse_pair, nargs="+", help="our decode cases BATCHxCONTEXT")
    parser.add_argument("--peer-decode", type=parse_pair, nargs="*", help="the peer's decode cases BATCHxCONTEXT")
    parser.add_argument("--workloads", type=parse_workload, nargs="+", help="offline workloads REQUESTSxIN/OUT")
    parser.add_argument("--prefill", type=parse_pair, help="prefill workload REQUESTSxINPUT")
    parser.add_argument("--peer-max-batches", type=int, help="run only the peer's first k batches of each workload")
    return parser.parse_args()


def preset_of(args: argparse.Namespace) -> Preset:
    """The model's preset with the sizes given on the command line."""
    names = ("decode", "peer_decode", "workloads", "prefill", "peer_max_batches")
    sizes = {name: getattr(args, name) for name in names}
    return dataclasses.replace(PRESETS[args.model], **{k: v for k, v in sizes.items() if v is not None})


def device_name(results: dict) -> str | None:
    sources = [results.get("floors"), results.get("peer")] + results.get("decode", {}).get("runs", [])
    return next((s["device"] for s in sources if s and "device" in s), None)


def main() -> None:
    args = parse_args()
    preset = preset_of(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "e2e.log"
    log.write_text("")
    parts = "".join(dict.fromkeys(args.parts))
    results: dict = {
        "meta": {
            "model": args.model,
            "parts": parts,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "argv": sys.argv,
            "preset": dataclasses.asdict(preset),
        }
    }
    with tempfile.TemporaryDirectory(prefix="e2e-") as scratch:
        harness = Harness(args.model, preset, Path(scratch), log, args.timeout, time.monotonic() + args.budget)
        for part in parts:
            name, measure = PART_FUNCTIONS[part]
            try:
                results[name] = measure(harness)
            except Exception as exc:  # a bug in this harness: keep what the other parts measure
                results.setdefault("harness_errors", {})[name] = {"error": repr(exc)}
            results["meta"]["device"] = device_name(results)
            results["summary"] = guarded_summary(results, preset)
            (out_dir / "e2e.json").write_text(json.dumps(results, indent=2))
    if results["summary"].get("decode"):
        plot_decode(results["summary"]["decode"], out_dir / "decode_vs_floor.png")
    print("\n".join(table(results)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2:])
    else:
        main()
