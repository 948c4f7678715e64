"""Mixture-of-experts: the grouped matmul and the experts against dense loops, the router's semantics,
stacked experts read back from per-expert tensors, and the experts split under tensor parallelism."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import save_tiny_hf_model
from packed_batch import packed_metadata
from safetensors.numpy import load_file
from test_model_parity import jitted_step, pack, random_caches, random_prompts, rel_err
from test_sharding import tp_mesh

from jaxrunner.engine.llm import LLM
from jaxrunner.models import load_model
from jaxrunner.models.layers import ACTIVATIONS
from jaxrunner.models.loader import hf_tensors
from jaxrunner.models.moe import AUTO, MoEConfig, SparseMoeBlock, experts_forward, route
from jaxrunner.models.tokenizer import build_byte_tokenizer
from jaxrunner.ops.grouped_matmul import grouped_matmul
from jaxrunner.sharding import kv_cache_sharding


def test_grouped_matmul_equals_a_loop_over_groups():
    """Groups of 0, 1 and many rows, in order; each group's rows times its own matrix."""
    sizes = np.array([3, 0, 1, 7, 0, 5], np.int32)
    rng = np.random.default_rng(0)
    lhs = rng.standard_normal((sizes.sum(), 24), np.float32)
    rhs = rng.standard_normal((len(sizes), 24, 40), np.float32)
    want = np.concatenate(
        [lhs[a:b] @ rhs[g] for g, (a, b) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes)))]
    )
    got = jax.jit(grouped_matmul)(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_route_keeps_the_top_k_of_the_softmax_over_every_expert():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    weights, experts = route(logits, 2, renormalize=False)
    assert np.asarray(experts).tolist() == [[1, 2], [3, 0]]
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(experts), 1), rtol=1e-6)
    renormalized, _ = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(np.asarray(renormalized).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "gathered"])
def test_experts_equal_a_dense_loop_over_each_tokens_experts(impl):
    """Every token through each of its top-k experts, one at a time, weighted and summed."""
    tokens, hidden, features, num_experts, top_k = 13, 16, 24, 5, 2
    rng = np.random.default_rng(1)
    x = rng.standard_normal((tokens, hidden), np.float32)
    gate_up = rng.standard_normal((num_experts, hidden, 2, features), np.float32) * 0.3
    down = rng.standard_normal((num_experts, features, hidden), np.float32) * 0.3
    weights, experts = route(jnp.asarray(rng.standard_normal((tokens, num_experts), np.float32)), top_k, True)
    act = ACTIVATIONS["silu"]
    got = jax.jit(experts_forward, static_argnums=(5, 6))(
        jnp.asarray(x), weights, experts, jnp.asarray(gate_up), jnp.asarray(down), act, impl
    )
    want = np.zeros_like(x)
    for t in range(tokens):
        for k in range(top_k):
            e = int(experts[t, k])
            h = np.asarray(act(jnp.asarray(x[t] @ gate_up[e, :, 0]))) * (x[t] @ gate_up[e, :, 1])
            want[t] += float(weights[t, k]) * (h @ down[e])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "phi3"])
def test_hf_tensors_give_back_per_expert_and_fused_checkpoints(arch, tmp_path):
    """Stacking experts (and cutting Phi-3's fused tensors) at load, then splitting at export, round-trips;
    Mixtral's and Phi-3's names come back in this package's naming."""
    save_tiny_hf_model(arch, tmp_path, seed=3)
    original = load_file(str(tmp_path / "model.safetensors"))
    exported = hf_tensors(load_model(tmp_path)[0])
    if arch == "mixtral":
        from jaxrunner.models.moe import mixtral_tensor_name

        original = {mixtral_tensor_name(name): t for name, t in original.items()}
    if arch == "phi3":
        qkv = original.pop("model.layers.0.self_attn.qkv_proj.weight")
        np.testing.assert_array_equal(
            np.concatenate([exported[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]), qkv
        )
        return
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)


def _step_logits(checkpoint, mesh=None) -> tuple[np.ndarray, Any, Any]:
    """One packed prefill step of two prompts through the checkpoint's model: its logits, the model, its config."""
    lens = [9, 14]
    prompts = random_prompts(1031, lens, seed=4)
    metadata, positions = packed_metadata(lens, block_size=4, num_blocks=24, num_tokens=24, num_reqs=2)
    model, config = load_model(checkpoint, mesh=mesh)
    caches = random_caches(config, jnp.float32, 1)
    if mesh is not None:
        caches = jax.device_put(caches, kv_cache_sharding(mesh))
    out, _ = jitted_step(model)(pack(prompts, 24), jnp.asarray(positions), caches, metadata)
    return np.asarray(out)[: sum(lens)], model, config


def test_experts_split_over_tensor_parallel_devices_give_the_same_logits(tmp_path):
    """Each device holds its slice of every expert's features; the logits equal one device's."""
    save_tiny_hf_model("qwen3_moe", tmp_path, seed=2)
    logits = []
    for tp in (1, 2):
        out, model, config = _step_logits(tmp_path, tp_mesh(tp))
        assert config.moe is not None
        experts = model.model.layers[0].mlp.experts.gate_up_proj
        assert experts[...].sharding.shard_shape(experts[...].shape)[-1] == config.moe.intermediate_size // tp
        logits.append(out)
    assert rel_err(logits[1], logits[0]) < 1e-5


@pytest.mark.parametrize("tokens, grouped", [(2, False), (3, True)])
def test_auto_gathers_while_pairs_are_few_and_groups_beyond(tokens, grouped):
    """Unforced, a program of at most a quarter as many (token, expert) pairs as experts gathers each pair's
    matrices (no ``ragged_dot`` in its program), a larger one sorts and groups; both equal the grouped path."""
    config = MoEConfig(num_experts=16, top_k=2, intermediate_size=24, renormalize=True, sparse_layers=(0,))
    block = SparseMoeBlock(16, config, "silu", dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert block.impl == AUTO
    x = jnp.asarray(np.random.default_rng(3).standard_normal((tokens, 16), np.float32))
    program = str(jax.make_jaxpr(lambda x: block(x))(x))
    assert ("ragged_dot" in program) == grouped
    auto = np.asarray(block(x))
    block.impl = "reference"
    np.testing.assert_allclose(auto, np.asarray(block(x)), rtol=1e-5, atol=1e-6)


def test_lora_on_a_mixture_of_experts_model_is_refused(tmp_path, cache_dir):
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("qwen3_moe", tmp_path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        LLM(str(tmp_path), enable_lora=True, num_gpu_blocks_override=16, compilation_cache_dir=cache_dir)


def test_a_forced_moe_impl_reaches_every_sparse_layer_with_the_same_logits(tmp_path, monkeypatch):
    """``$JAXRUNNER_MOE_IMPL=gathered`` runs every sparse layer's experts by gathered matrices: the logits
    equal the sorted ``ragged_dot`` path's; a name that is no impl is refused, naming the variable."""
    save_tiny_hf_model("qwen3_moe", tmp_path, seed=2)
    logits = []
    for impl in (None, "gathered"):
        if impl:
            monkeypatch.setenv("JAXRUNNER_MOE_IMPL", impl)
        out, model, config = _step_logits(tmp_path)
        assert config.moe is not None
        impls = {model.model.layers[i].mlp.impl for i in config.moe.sparse_layers}
        assert impls == {impl or AUTO}
        logits.append(out)
    assert rel_err(logits[1], logits[0]) < 1e-5
    monkeypatch.setenv("JAXRUNNER_MOE_IMPL", "dense")
    with pytest.raises(ValueError, match="JAXRUNNER_MOE_IMPL"):
        load_model(tmp_path)
