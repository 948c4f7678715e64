"""A model converted with orbax-checkpoint (``models/converted.py``) restores with the logits of the model it
was converted from, unsharded and split over devices, in float32 and bf16, without reading a safetensors
tensor; mismatched loads are refused."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import save_tiny_hf_model
from packed_batch import packed_metadata
from test_model_parity import jitted_step, pack, random_caches, random_prompts
from test_sharding import tp_mesh

from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import CheckpointError, load_model, loader
from jaxrunner.models.converted import MANIFEST_FILE, save_converted
from jaxrunner.models.tokenizer import build_byte_tokenizer
from jaxrunner.sharding import kv_cache_sharding

LENS = [7, 12]


def logits_of(model, config, mesh) -> np.ndarray:
    metadata, positions = packed_metadata(LENS, block_size=4, num_blocks=16, num_tokens=24, num_reqs=2)
    caches = jax.device_put(random_caches(config, model.dtype, 3), kv_cache_sharding(mesh))
    prompts = random_prompts(config.vocab_size, LENS, seed=2)
    out, _ = jitted_step(model)(pack(prompts, 24), jnp.asarray(positions), caches, metadata)
    return np.asarray(out)[: sum(LENS)]


def no_safetensors(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a converted model read a safetensors tensor")

    monkeypatch.setattr(loader, "iter_tensors", refuse)


@pytest.mark.parametrize(("dtype", "tp"), [("float32", 1), ("bfloat16", 1), ("float32", 2)])
def test_restored_model_gives_the_logits_it_was_converted_with(dtype, tp, tmp_path, monkeypatch):
    source, out = tmp_path / "hf", tmp_path / "converted"
    save_tiny_hf_model("qwen3", source, seed=4)
    mesh = tp_mesh(tp)
    model, config = load_model(source, dtype=dtype, mesh=mesh)
    save_converted(nnx.state(model), model, source, out)
    assert (out / "config.json").is_file() and not list(out.glob("*.safetensors"))

    no_safetensors(monkeypatch)
    restored, _ = load_model(out, dtype=dtype, mesh=mesh)
    kernel = restored.model.layers[0].self_attn.qkv_proj.kernel[...]
    assert (
        kernel.dtype == jnp.dtype(dtype)
        and kernel.sharding == model.model.layers[0].self_attn.qkv_proj.kernel[...].sharding
    )
    np.testing.assert_array_equal(logits_of(restored, config, mesh), logits_of(model, config, mesh))


def test_a_load_unlike_the_conversion_is_refused_with_what_to_pass(tmp_path):
    source, out = tmp_path / "hf", tmp_path / "converted"
    save_tiny_hf_model("llama", source)
    model, _ = load_model(source, mesh=tp_mesh(2))  # vocabulary 1031 padded to 1032
    save_converted(nnx.state(model), model, source, out)
    with pytest.raises(CheckpointError, match="dtype='float32'"):
        load_model(out, dtype="bfloat16", mesh=tp_mesh(2))
    with pytest.raises(CheckpointError, match="tensor_parallel_size=2"):
        load_model(out, mesh=tp_mesh(1))
    with pytest.raises(FileExistsError):
        save_converted(nnx.state(model), model, source, out)
    assert (out / MANIFEST_FILE).is_file()


def test_llm_serves_its_converted_model_with_the_same_tokens(tmp_path, cache_dir, monkeypatch):
    tokenizer = build_byte_tokenizer()
    source, out = tmp_path / "hf", tmp_path / "converted"
    save_tiny_hf_model("llama", source, seed=6, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(source)
    kwargs: dict[str, Any] = dict(
        dtype="float32",
        max_model_len=64,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        num_gpu_blocks_override=32,
        compilation_cache_dir=cache_dir,
        token_buckets=[8, 32],
        request_buckets=[2],
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(source), **kwargs)
    want = [o.outputs[0].text for o in llm.generate(["Hello", "JAX is"], params, use_tqdm=False)]
    llm.save_converted(str(out))

    no_safetensors(monkeypatch)
    got = [o.outputs[0].text for o in LLM(str(out), **kwargs).generate(["Hello", "JAX is"], params, use_tqdm=False)]
    assert got == want
    with pytest.raises(ValueError, match="no checkpoint directory"):
        LLM("tiny-llama", num_gpu_blocks_override=16, compilation_cache_dir=cache_dir).save_converted(
            str(tmp_path / "x")
        )
