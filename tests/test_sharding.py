"""Tensor and data parallelism on the eight CPU devices of ``conftest.py``.

Every sharded run is compared with the unsharded one in float32: logits to a
relative error under 1e-5, greedy tokens exactly. Shard sizes are read from the
arrays themselves; precompiled runners must compile nothing more.
"""

import functools
import os
import socket
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import save_tiny_hf_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from packed_batch import packed_metadata
from runner_driver import HandScheduler, make_runner
from test_attention_reference import Case, _make_inputs
from test_model_parity import jitted_step, pack, random_caches, random_prompts, rel_err

from jaxrunner.compat import mosaic_gpu_interpreter_on_several_devices
from jaxrunner.config import CacheConfig, ParallelConfig
from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import TransformerConfig, init_random_model, load_model, loader
from jaxrunner.models.sharded_attention import write_and_attend
from jaxrunner.ops.attention_backend import AttentionBackend
from jaxrunner.runner.compilation import CompileCounter
from jaxrunner.sharding import MODEL_AXIS, kv_cache_sharding, make_mesh, replica_meshes

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or len(jax.devices()) < 8, reason="runs on the CPU split into 8 devices"
)
GREEDY = SamplingParams(temperature=0.0)
# Four KV heads (TP up to 4) and a vocabulary no TP size divides: the padded rows are exercised.
CONFIG = TransformerConfig(
    vocab_size=1001,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    max_position_embeddings=256,
)


def tp_mesh(tp: int):
    return make_mesh(ParallelConfig(tensor_parallel_size=tp))


def assert_split_evenly(params: nnx.State, mesh) -> None:
    """Every parameter lies on all of ``mesh``'s devices; each device holds 1/TP of the ones split on
    ``model`` and the whole of the others (norms)."""
    tp = mesh.shape[MODEL_AXIS]
    held = dict.fromkeys(mesh.devices.flat, 0)
    split_bytes = whole_bytes = 0
    for array in jax.tree.leaves(params):
        split = MODEL_AXIS in jax.tree.leaves(tuple(array.sharding.spec))
        assert array.sharding.device_set == set(mesh.devices.flat)
        for shard in array.addressable_shards:
            assert shard.data.size == (array.size // tp if split else array.size)
            held[shard.device] += shard.data.nbytes
        split_bytes += array.nbytes if split else 0
        whole_bytes += 0 if split else array.nbytes
    assert split_bytes > 20 * whole_bytes
    assert set(held.values()) == {split_bytes // tp + whole_bytes}


def assert_megatron_layout(model) -> None:
    """Column-parallel q/k/v and gate/up, row-parallel o/down, vocabulary-split embedding, replicated norms."""
    layer = model.model.layers[0]
    spec = lambda param: param[...].sharding.spec
    assert spec(layer.self_attn.qkv_proj.kernel) == P(None, MODEL_AXIS, None, None)
    assert spec(layer.mlp.gate_up_proj.kernel) == P(None, None, MODEL_AXIS)
    assert spec(layer.self_attn.o_proj.kernel) == spec(layer.mlp.down_proj.kernel) == P(MODEL_AXIS, None)
    assert spec(model.model.embed_tokens.embedding) == P(MODEL_AXIS, None)
    assert spec(layer.input_layernorm.weight) == P(None)


# ------------------------------------------------------------------- layouts


def test_mesh_rows_are_replicas_and_impossible_layouts_are_refused():
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=2, data_parallel_size=3))
    assert dict(mesh.shape) == {"data": 3, "model": 2}
    rows = [set(m.devices.flat) for m in replica_meshes(mesh)]
    assert len(set.union(*rows)) == 6 and all(len(r) == 2 for r in rows)
    with pytest.raises(ValueError, match="needs 16 devices, but only 8 are present"):
        make_mesh(ParallelConfig(tensor_parallel_size=4, data_parallel_size=4))
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        ParallelConfig(tensor_parallel_size=0)
    two_kv_heads = TransformerConfig(**{**CONFIG.__dict__, "num_heads": 4, "num_kv_heads": 2})
    with pytest.raises(
        ValueError,
        match=r"does not divide the model's num_kv_heads \(2\).*replicating KV heads"
        r".*not supported.*in \[1, 2\]",
    ):
        init_random_model(two_kv_heads, mesh=tp_mesh(4))
    odd_mlp = TransformerConfig(**{**CONFIG.__dict__, "intermediate_size": 130})
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size \(130\).*in \[1, 2\]"):
        init_random_model(odd_mlp, mesh=tp_mesh(4))
    with pytest.raises(ValueError, match="num_kv_heads"):  # the built-in tiny model has 2 KV heads
        LLM("tiny-llama", tensor_parallel_size=4, compilation_cache_dir="")
    with pytest.raises(ValueError, match="build it with mesh=runner.mesh"):
        make_runner(init_random_model(CONFIG), mesh=tp_mesh(2))


def test_random_init_is_sharded_and_the_same_on_any_mesh():
    whole = init_random_model(CONFIG, seed=3)
    mesh = tp_mesh(4)
    split = init_random_model(CONFIG, seed=3, mesh=mesh)
    assert_split_evenly(nnx.state(split), mesh)
    assert_megatron_layout(split)
    embedding = np.asarray(split.model.embed_tokens.embedding[...])
    assert embedding.shape == (1004, 64) and not embedding[1001:].any()  # padded to a multiple of 4 with zeros
    for a, b in zip(jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(split))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[tuple(slice(n) for n in a.shape)])


# -------------------------------------------------------- logits and tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) with four KV heads and a 1031-token vocabulary."""
    path = tmp_path_factory.mktemp("qwen2")
    save_tiny_hf_model("qwen2", path, seed=5, num_key_value_heads=4)
    return path


def two_step_logits(model, config) -> np.ndarray:
    """Prefill chunks, then the rest of each prompt (a chunk and a decode) on the cache the first step wrote."""
    prompts = random_prompts(config.vocab_size, [14, 9, 21], seed=3)
    first, second = [8, 8, 21], [6, 1, 0]
    metadata = functools.partial(
        packed_metadata, block_size=4, num_blocks=24, blocks_per_req=6, num_tokens=40, num_reqs=4
    )
    md1, pos1 = metadata(first)
    md2, pos2 = metadata([14, 9, 21], second)
    step = jitted_step(model)
    caches = jax.device_put(random_caches(config, jnp.float32, 4), kv_cache_sharding(model.mesh))
    logits1, caches = step(pack([p[:n] for p, n in zip(prompts, first)], 40), jnp.asarray(pos1), caches, md1)
    logits2, _ = step(pack([p[8:] for p in prompts[:2]], 40), jnp.asarray(pos2), caches, md2)
    assert logits1.shape[1] == config.vocab_size  # the padded vocabulary never reaches the logits
    return np.concatenate([np.asarray(logits1)[: sum(first)], np.asarray(logits2)[: sum(second)]])


@pytest.fixture(scope="module")
def unsharded_logits(checkpoint):
    return two_step_logits(*load_model(checkpoint))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_logits_equal_unsharded_and_each_device_reads_its_slice(tp, checkpoint, unsharded_logits, monkeypatch):
    read: dict[str, list[float]] = {"plain": [], "merged": []}
    read_plain, read_merged = loader._read_shard, loader._read_merged_shard

    def plain(source, index, shape, dtype):
        shard = read_plain(source, index, shape, dtype)
        read["plain"].append(shard.size / np.prod(shape))
        return shard

    def merged(views, index, slot_axis, dtype):
        shard = read_merged(views, index, slot_axis, dtype)
        read["merged"].append(shard.size / sum(view.size for view in views))
        return shard

    monkeypatch.setattr(loader, "_read_shard", plain)
    monkeypatch.setattr(loader, "_read_merged_shard", merged)
    mesh = tp_mesh(tp)
    model, config = load_model(checkpoint, mesh=mesh)
    assert max(read["plain"]) == 1.0 and min(read["plain"]) == 1 / tp  # norms whole, the rest a 1/TP slice
    assert set(read["merged"]) == {1 / tp}  # q/k/v and gate/up: each device read its slice of each part
    assert_split_evenly(nnx.state(model), mesh)
    assert_megatron_layout(model)
    err = rel_err(two_step_logits(model, config), unsharded_logits)
    print(f"TP={tp}: logits relative error {err:.2e}")
    assert err < 1e-5


GREEDY_PROMPTS = random_prompts(CONFIG.vocab_size, [5, 37, 17, 16, 1, 30], seed=7)


def run_greedy(runner, prompts) -> dict[str, list[int]]:
    scheduler = HandScheduler(runner, token_budget=24, max_chunk=13, seed=1)
    for i, prompt in enumerate(prompts):
        scheduler.add(f"r{i}", prompt, GREEDY, max_tokens=20)
    return scheduler.run()


def small_runner(model, mesh=None):
    """The runner the greedy tensor-parallel tests share."""
    return make_runner(
        model, mesh=mesh, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[8, 32], request_buckets=[4]
    )


@pytest.fixture(scope="module")
def unsharded_greedy():
    return run_greedy(small_runner(init_random_model(CONFIG, seed=1)), GREEDY_PROMPTS)


@pytest.mark.parametrize("tp", [2, 4])
def test_runner_greedy_equals_unsharded_with_no_compile_after_capture(tp, unsharded_greedy):
    mesh = tp_mesh(tp)
    runner = small_runner(init_random_model(CONFIG, seed=1, mesh=mesh), mesh)
    runner.capture_model()
    compiled = CompileCounter.count()
    assert run_greedy(runner, GREEDY_PROMPTS) == unsharded_greedy
    assert CompileCounter.count() == compiled
    assert runner.kv_caches is not None
    k_cache = runner.kv_caches[0][0]
    assert isinstance(k_cache.sharding, NamedSharding) and k_cache.sharding.spec == P(None, None, MODEL_AXIS, None)
    assert {s.data.shape[2] for s in k_cache.addressable_shards} == {CONFIG.num_kv_heads // tp}
    # Each device holds 1/TP of every block, so a per-device budget buys TP times the blocks.
    per_device = runner.kv_cache_spec.per_device(tp).bytes_per_block
    assert per_device * tp == runner.kv_cache_spec.bytes_per_block
    runner.cache_config = CacheConfig(cpu_kv_cache_bytes=20 * per_device)
    assert runner.initialize_kv_cache() == 20


def test_data_parallel_replicas_equal_one_device(tmp_path):
    """TP=2 x DP=2: prompts spread over both replicas, outputs in prompt order, tokens and logprobs as on one device."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 70, 33, 16, 1, 48, 27, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    tiny_llm = functools.partial(
        LLM,
        "tiny-llama",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=64,
        token_buckets=[64],
        request_buckets=[4],
        compilation_cache_dir=str(tmp_path),
    )
    single = tiny_llm().generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(tensor_parallel_size=2, data_parallel_size=2)
    engines = llm.replicas.engines
    assert len({d for e in engines for d in e.runner.mesh.devices.flat}) == 4
    compiled = CompileCounter.count()
    spread = llm.generate(prompts, params, use_tqdm=False)
    assert CompileCounter.count() == compiled
    assert all(e.scheduler.num_scheduled_tokens_total > 0 for e in engines)
    assert [o.prompt_token_ids for o in spread] == prompts
    assert [o.outputs[0].token_ids for o in spread] == [o.outputs[0].token_ids for o in single]
    logprobs = lambda outputs: np.array(
        [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    )
    err = rel_err(logprobs(spread), logprobs(single))
    print(f"TP=2 x DP=2: logprobs of the sampled tokens, relative error {err:.2e}")
    assert err < 1e-5
    # Unseeded sampling: the same prompt on both replicas must not draw the same seeds.
    sampled = llm.generate([prompts[0]] * 4, SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in sampled}) == 4


def test_mosaic_gpu_kernel_runs_per_kv_head_shard_in_the_interpreter():
    """The KV write and the Mosaic GPU kernel under shard_map (TP=2) against the unsharded reference."""
    case = Case(reqs=((17, 3), (0, 1)), num_q_heads=4, num_kv_heads=2, head_dim=64, pad_tokens=1, pad_reqs=0)
    q, k_cache, v_cache, metadata = _make_inputs(case, seed=0)
    k, v = (jax.random.normal(key, (q.shape[0], 2, 64)) for key in jax.random.split(jax.random.key(1)))
    mesh = tp_mesh(2)
    reference_ops = AttentionBackend("reference")
    mosaic_gpu = AttentionBackend.for_devices(list(mesh.devices.flat), "mosaic_gpu")  # interpreted on the CPU
    reference = jax.jit(lambda *a: write_and_attend(*a, mesh=None, backend=reference_ops, sm_scale=0.125))
    kernel = jax.jit(lambda *a: write_and_attend(*a, mesh=mesh, backend=mosaic_gpu, sm_scale=0.125))
    want, want_caches = reference(q, k, v, (k_cache, v_cache), metadata)
    with mosaic_gpu_interpreter_on_several_devices():
        got, got_caches = kernel(q, k, v, jax.device_put((k_cache, v_cache), kv_cache_sharding(mesh)), metadata)
        got = np.asarray(got)
    assert got_caches[0].sharding.spec == P(None, None, MODEL_AXIS)
    np.testing.assert_array_equal(np.asarray(got_caches[1]), np.asarray(want_caches[1]))
    assert rel_err(got, np.asarray(want)) < 1e-5


def test_two_processes_share_one_tensor_parallel_model(tmp_path):
    """The several-host path on one machine: two processes of one CPU device each, jax.distributed, TP=2."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "XDG_CACHE_HOME": str(tmp_path),
        "JAX_PLATFORMS": "cpu",
    }
    prompts = ["Hi", "Hello there"]
    # The same engine shape as CLI flags and as LLM's keywords.
    shape: dict[str, Any] = dict(
        max_num_seqs=2, max_num_batched_tokens=16, token_buckets=[16], request_buckets=[2], num_gpu_blocks_override=16
    )
    flags = [f"--{k.replace('_', '-')}={v[0] if isinstance(v, list) else v}" for k, v in shape.items()]
    command = ["generate", "--max-tokens=4", "--tensor-parallel-size=2", *flags, *(f"--prompt={p}" for p in prompts)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxrunner.launch",
                f"--coordinator-address=localhost:{port}",
                "--num-processes=2",
                f"--process-id={i}",
                *command,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    single = LLM("tiny-llama", compilation_cache_dir="", **shape)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    texts = [o.outputs[0].text for o in single.generate(prompts, greedy, use_tqdm=False)]
    expected = [f"{p!r} -> {t!r} (length)" for p, t in zip(prompts, texts)]
    for out in outputs:  # each process prints every output
        assert [line for line in out.splitlines() if " -> " in line] == expected
