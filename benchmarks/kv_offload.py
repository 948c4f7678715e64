"""Host-memory KV offloading on a multi-turn workload whose shared prefixes exceed the device's cache, and what
the KV connector's hooks cost when they move nothing.

``--documents`` documents of ``--doc-len`` random tokens take turns: each turn is
one request, a document followed by a new question of ``--question-len`` tokens,
``--output-len`` tokens out, one turn at a time (a user working through several
long documents). The device's cache holds ``--gpu-blocks`` blocks, fewer than the
documents take, so by the time a document comes round again the device has
evicted it. Three engines run the same turns in one process: no connector, the
offloading connector (a host pool of ``--cpu-blocks``), and the no-op connector.
Reported: the mean time to first token of the turns after the first round (the
documents' second and later visits), offloading against computing them again;
and the whole run's time with the no-op connector against none.

On the GPU (Llama-3-8B's shape; about 5 minutes):

    python -m benchmarks.kv_offload --out kv_offload.json

On a CPU, to check the script:

    python -m benchmarks.kv_offload --model tiny-llama --documents 3 --doc-len 96 --question-len 8 \\
        --output-len 4 --rounds 2 --gpu-blocks 16 --cpu-blocks 64 --out /tmp/kv_offload.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from benchmarks.harness import device_facts, write_json
from jaxrunner import LLM, SamplingParams


def turns(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Every turn's prompt, round after round over the documents, each with a question of its own."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, vocab, args.doc_len).tolist() for _ in range(args.documents)]
    return [doc + rng.integers(3, vocab, args.question_len).tolist() for _ in range(args.rounds) for doc in documents]


def run(args: argparse.Namespace, prompts: list[list[int]], connector: dict | None, cache_dir: str) -> dict:
    llm = LLM(
        args.model,
        max_model_len=args.doc_len + args.question_len + args.output_len,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
        token_buckets=[4, args.max_num_batched_tokens],
        request_buckets=[4],
        num_gpu_blocks_override=args.gpu_blocks,
        kv_transfer_config=connector,
        compilation_cache_dir=cache_dir,  # shared: the later engines load the step programs the first compiled
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:8]}, params, use_tqdm=False)  # warm-up
    ttft, outputs = [], []
    began = time.perf_counter()
    for prompt in prompts:
        start = time.monotonic()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.metrics is not None and out.metrics.first_token_time is not None
        ttft.append(out.metrics.first_token_time - start)
        outputs.append(list(out.outputs[0].token_ids))
    wall = time.perf_counter() - began
    later = ttft[args.documents :]  # the documents' second and later visits
    runner = llm.llm_engine.runner
    stats = runner.kv_connector.stats
    result = dict(
        wall_s=wall,
        ttft_s=ttft,
        # Host seconds in the connector's hooks, warm-up included: loads (with storing the saves that landed),
        # and saves (gathering blocks and starting their copies to the host).
        kv_load_host_s=runner.spans.seconds.get("kv_load", 0.0),
        kv_save_host_s=runner.spans.seconds.get("kv_save", 0.0),
        ttft_later_mean_s=statistics.mean(later),
        ttft_first_round_mean_s=statistics.mean(ttft[: args.documents]),
        computed_tokens=llm.llm_engine.scheduler.num_scheduled_tokens_total,
        loaded_tokens=stats.loaded_tokens,
        saved_blocks=stats.saved_blocks,
        outputs=outputs,
    )
    del llm
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-llama3-8b")
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--doc-len", type=int, default=8000)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-blocks", type=int, default=2048, help="the device cache: 32k tokens of 16")
    parser.add_argument("--cpu-blocks", type=int, default=8192, help="the host pool: 128k tokens of 16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--out", default="kv_offload.json")
    args = parser.parse_args()
    from jaxrunner.models.builtin import BUILTIN_MODELS

    prompts = turns(args, BUILTIN_MODELS[args.model].vocab_size if args.model in BUILTIN_MODELS else 32000)
    offload = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": args.cpu_blocks}}
    with tempfile.TemporaryDirectory() as cache_dir:
        runs = {
            "none": run(args, prompts, None, cache_dir),
            "offloading": run(args, prompts, offload, cache_dir),
            "noop": run(args, prompts, {"kv_connector": "NoOpConnector"}, cache_dir),
        }
    same = all(r["outputs"] == runs["none"]["outputs"] for r in runs.values())
    result = dict(
        **device_facts(),
        args=vars(args),
        same_tokens=same,
        ttft_offloading_over_recompute=runs["offloading"]["ttft_later_mean_s"] / runs["none"]["ttft_later_mean_s"],
        noop_over_none_wall=runs["noop"]["wall_s"] / runs["none"]["wall_s"],
        runs={name: {k: v for k, v in r.items() if k != "outputs"} for name, r in runs.items()},
    )
    write_json(args.out, result)
    print({k: v for k, v in result.items() if k not in ("args", "runs")})


if __name__ == "__main__":
    main()
