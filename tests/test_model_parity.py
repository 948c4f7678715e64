"""Our loaded models against transformers: same checkpoint, same prompt logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import hf_logits, save_tiny_hf_model
from packed_batch import packed_metadata

from jaxrunner.models import CausalLM, TransformerConfig, init_random_model, load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24
PROMPT_LENS = [5, 19, 12]  # longer than the test sliding windows, and not block-aligned
NUM_TOKENS = 40  # padded, as the runner's token bucket would be
NUM_REQS = 4  # one padded request

CASES = {
    "llama": ("llama", {}, None),
    "llama3": ("llama3", {}, None),
    "mistral": ("mistral", {}, None),
    "qwen2": ("qwen2", {}, None),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, None),
    "qwen3": ("qwen3", {}, None),
    "llama-tied-sharded": ("llama", {"tie_word_embeddings": True}, "100KB"),
    "phi3-short-rope": ("phi3", {}, None),
    "phi3-long-rope": ("phi3", {"original_max_position_embeddings": 4}, None),
    "gemma2": ("gemma2", {}, None),
    "gemma3": ("gemma3", {}, None),
    "mixtral": ("mixtral", {}, None),
    "qwen3-moe": ("qwen3_moe", {}, None),
}
SERVED_LENGTH = {"phi3-short-rope": 64}
"""``max_model_len`` of a case served shorter than the model's positions: LongRoPE then takes its short
factors, as transformers does for prompts within ``original_max_position_embeddings``. The long case's
prompts all pass that length, so transformers takes the long factors, as served at full length."""


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def random_caches(config: TransformerConfig, dtype, seed: int) -> list[tuple[jax.Array, jax.Array]]:
    """Per-layer K/V caches full of noise, so reading an unwritten slot shows in the logits."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    keys = jax.random.split(jax.random.key(seed), 2 * config.num_layers)
    return [
        (jax.random.normal(keys[2 * i], shape, dtype), jax.random.normal(keys[2 * i + 1], shape, dtype))
        for i in range(config.num_layers)
    ]


def jitted_step(model: CausalLM):
    """The model as the runner runs it: split once, merged inside jit, logits of every token."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, input_ids, positions, kv_caches, metadata):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(input_ids, positions, kv_caches, metadata)
        return m.compute_logits(hidden), kv_caches

    return lambda *args: step(state, *args)


def pack(prompts: list[list[int]], num_tokens: int) -> jnp.ndarray:
    ids = np.zeros(num_tokens, np.int32)
    flat = np.concatenate(prompts)
    ids[: len(flat)] = flat
    return jnp.asarray(ids)


def random_prompts(vocab_size: int, lens: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lens]


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_match_transformers(case, tmp_path):
    arch, overrides, shard_size = CASES[case]
    hf_config = save_tiny_hf_model(arch, tmp_path, max_shard_size=shard_size, **overrides)
    model, config = load_model(tmp_path, max_model_len=SERVED_LENGTH.get(case))
    prompts = random_prompts(config.vocab_size, PROMPT_LENS, seed=1)
    metadata, positions = packed_metadata(
        PROMPT_LENS, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_tokens=NUM_TOKENS, num_reqs=NUM_REQS
    )

    logits, _ = jitted_step(model)(
        pack(prompts, NUM_TOKENS), jnp.asarray(positions), random_caches(config, jnp.float32, 2), metadata
    )

    ours = np.asarray(logits)[: sum(PROMPT_LENS)]
    ref = np.concatenate(hf_logits(tmp_path, prompts))
    assert hf_config.vocab_size >= 1000 and config.num_heads > config.num_kv_heads
    assert np.isfinite(ours).all()
    assert rel_err(ours, ref) < 1e-4


def test_chunked_prefill_and_decode_continue_the_cache(tmp_path):
    """Step 1 prefills part of each prompt; step 2 schedules the rest (a chunk, a decode) on the same cache."""
    save_tiny_hf_model("qwen3", tmp_path)
    model, config = load_model(tmp_path)
    step = jitted_step(model)
    prompts = random_prompts(config.vocab_size, [14, 9], seed=3)
    first, second = [8, 8], [6, 1]
    metadata = functools.partial(
        packed_metadata, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, blocks_per_req=4, num_tokens=16, num_reqs=2
    )
    md1, pos1 = metadata(first)
    md2, pos2 = metadata([14, 9], second)

    _, caches = step(pack([p[:8] for p in prompts], 16), jnp.asarray(pos1), random_caches(config, jnp.float32, 4), md1)
    logits, _ = step(pack([p[8:] for p in prompts], 16), jnp.asarray(pos2), caches, md2)

    ours = np.asarray(logits)[: sum(second)]
    ref = np.concatenate([full[8:] for full in hf_logits(tmp_path, prompts)])
    assert rel_err(ours, ref) < 1e-4


def test_bfloat16_params_and_compute_stay_close(tmp_path):
    save_tiny_hf_model("llama", tmp_path)
    model32, config = load_model(tmp_path)
    model16, _ = load_model(tmp_path, dtype="bfloat16")
    assert model16.model.layers[0].mlp.gate_up_proj.kernel[...].dtype == jnp.bfloat16
    prompts = random_prompts(config.vocab_size, PROMPT_LENS, seed=5)
    metadata, positions = packed_metadata(PROMPT_LENS, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    args = (pack(prompts, sum(PROMPT_LENS)), jnp.asarray(positions))

    logits32, _ = jitted_step(model32)(*args, random_caches(config, jnp.float32, 6), metadata)
    logits16, _ = jitted_step(model16)(*args, random_caches(config, jnp.bfloat16, 6), metadata)

    assert logits16.dtype == jnp.float32
    assert rel_err(np.asarray(logits16), np.asarray(logits32)) < 3e-2


def test_init_random_model_runs(tmp_path):
    config = TransformerConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = init_random_model(config, dtype="bfloat16", seed=0)
    metadata, positions = packed_metadata([7], block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_tokens=8)

    logits, caches = jitted_step(model)(
        pack([[1, 2, 3, 4, 5, 6, 7]], 8), jnp.asarray(positions), random_caches(config, jnp.bfloat16, 7), metadata
    )

    assert logits.shape == (8, 1000) and np.isfinite(np.asarray(logits)).all()
    assert len(caches) == 2 and caches[0][0].dtype == jnp.bfloat16


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_tensors_give_back_the_checkpoint(arch, tmp_path):
    """Merging q/k/v and gate/up at load and splitting them at export are inverses, biases and norms included."""
    from safetensors.numpy import load_file

    from jaxrunner.models.loader import hf_tensors

    save_tiny_hf_model(arch, tmp_path, seed=3)
    original = load_file(str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path)
    exported = hf_tensors(model)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
