"""The KV cache a model gets at ``gpu_memory_utilization``, with and without sliding-window KV-cache groups.

For a model that mixes sliding-window and full attention (``--shape gemma3-12b``:
5 local layers of a 1,024-token window to 1 global), the runner either keeps a
KV-cache group per kind, whose sliding groups hold only their window's blocks
(vLLM's hybrid allocator, the default), or one group of full-length caches
(``disable_hybrid_kv_cache_manager``). Each way builds the runner on the same
random bf16 weights, sizes the cache by the memory budget (a real profile run of
the largest step) and reports the budget, vLLM's two figures (the cache size in
tokens, counted as if every group held every token, and the maximum concurrency
of ``--max-model-len``-token requests) and the tokens of context the cache then
holds: the concurrency times the request length. On a CPU the budget is
``--cpu-kv-cache-bytes``.

    python -m benchmarks.kv_capacity --shape gemma3-12b --max-model-len 32768 --out kv_capacity.json
"""

from __future__ import annotations

import argparse
import json

from benchmarks.harness import SHAPES, device_facts, device_memory, write_json
from jaxrunner.config import CacheConfig, CompilationConfig, ModelConfig, RunnerConfig, SchedulerConfig
from jaxrunner.engine.kv_cache_manager import KVCacheManager
from jaxrunner.models import CausalLM, init_random_model
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.sharding import make_mesh


def capacity(weights: CausalLM, args: argparse.Namespace, hybrid: bool) -> dict:
    """One runner's memory budget and what its cache holds, its KV-cache groups hybrid or one."""
    config = RunnerConfig(
        model_config=ModelConfig(dtype="bfloat16", max_model_len=args.max_model_len),
        cache_config=CacheConfig(
            gpu_memory_utilization=args.gpu_memory_utilization, cpu_kv_cache_bytes=args.cpu_kv_cache_bytes
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            disable_hybrid_kv_cache_manager=not hybrid,
        ),
        compilation_config=CompilationConfig(
            token_buckets=[args.max_num_batched_tokens], request_buckets=[args.max_num_seqs]
        ),
    )
    runner = ModelRunner(config, make_mesh(config.parallel_config))
    runner.load_model(weights)
    num_blocks = runner.initialize_kv_cache()
    assert runner.memory_budget is not None
    manager = KVCacheManager(num_blocks, runner.block_size, windows=runner.kv_cache_groups.windows)
    concurrency = manager.max_concurrency(args.max_model_len, args.max_num_batched_tokens)
    result = dict(
        hybrid=hybrid,
        kv_cache_groups=manager.num_groups,
        sliding_windows=[w for w in manager.windows if w is not None],
        bytes_per_block=runner.kv_cache_spec.bytes_per_block,
        **runner.memory_budget.summary(),
        max_concurrency=concurrency,
        context_tokens_held=int(concurrency * args.max_model_len),
        memory=device_memory(),
    )
    print(json.dumps(result), flush=True)
    runner.kv_caches = []
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-12b")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--cpu-kv-cache-bytes", type=int, default=CacheConfig.cpu_kv_cache_bytes, help="the budget on a CPU"
    )
    parser.add_argument("--out", default="kv_capacity.json")
    args = parser.parse_args()

    mesh = make_mesh(RunnerConfig().parallel_config)
    weights = init_random_model(SHAPES[args.shape], dtype="bfloat16", seed=0, mesh=mesh)
    ways = [capacity(weights, args, hybrid) for hybrid in (True, False)]
    hybrid, full = ways
    write_json(
        args.out,
        dict(
            benchmark="kv_capacity",
            **device_facts(),
            shape=args.shape,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            ways=ways,
            context_tokens_ratio=hybrid["context_tokens_held"] / full["context_tokens_held"],
        ),
    )
    print(f"sliding-window groups hold {hybrid['context_tokens_held'] / full['context_tokens_held']:.2f}x the tokens")


if __name__ == "__main__":
    main()
