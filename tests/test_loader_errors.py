"""Bad checkpoints and configs fail loudly, naming the file, shard or tensor at fault."""

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hf_models import save_tiny_hf_model, tiny_hf_config

from jaxrunner.models import CheckpointError, TransformerConfig, load_model, supported_architectures
from jaxrunner.models.builtin import BUILTIN_MODELS, check_model_name, load_named_model
from jaxrunner.models.safetensors_io import INDEX_FILE, iter_tensors
from jaxrunner.models.tokenizer import build_byte_tokenizer, load_tokenizer

SMALL: dict[str, Any] = dict(num_hidden_layers=2)  # config overrides


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory) -> dict[str, Path]:
    """One single-file and one sharded tiny Llama checkpoint, saved once for the module."""
    root = tmp_path_factory.mktemp("checkpoints")
    save_tiny_hf_model("llama", root / "single", **SMALL)
    save_tiny_hf_model("llama", root / "sharded", max_shard_size="100KB", **SMALL)
    return {"single": root / "single", "sharded": root / "sharded"}


@pytest.fixture
def single(saved_dirs, tmp_path) -> Path:
    return Path(shutil.copytree(saved_dirs["single"], tmp_path / "model"))


@pytest.fixture
def sharded(saved_dirs, tmp_path) -> Path:
    return Path(shutil.copytree(saved_dirs["sharded"], tmp_path / "model"))


def rewrite_tensors(path: Path, edit) -> None:
    """Rewrites a safetensors file with ``edit(dict of arrays)`` applied."""
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path)


def test_unknown_architecture_names_it_and_lists_supported(single):
    config_path = single / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(config_path))}: .*FancyNewForCausalLM") as info:
        load_model(single)
    assert all(name in str(info.value) for name in supported_architectures())


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"architectures": [', "not valid JSON"),
        ("[1, 2]", "holds a JSON list, not an object"),
        (None, "cannot be read"),
    ],
)
def test_config_that_does_not_parse_names_the_file(single, text, why):
    config_path = single / "config.json"
    if text is None:
        config_path.unlink()
    else:
        config_path.write_text(text)
    for load in (load_model, check_model_name, load_named_model):
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(config_path))}: {why}"):
            load(str(single))


def _rewrite_index(model_dir: Path, edit) -> None:
    path = model_dir / INDEX_FILE
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_index_that_does_not_parse_names_the_file(sharded):
    (sharded / INDEX_FILE).write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(sharded / INDEX_FILE))}: not valid JSON"):
        load_model(sharded)
    (sharded / INDEX_FILE).write_text('{"weight_map": ["model-00001.safetensors"]}')
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(sharded / INDEX_FILE))}: 'weight_map' must map"):
        load_model(sharded)


@pytest.mark.parametrize("outside", ["absolute", "parent"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(sharded, tmp_path, outside):
    """A shard is looked for inside the checkpoint directory only, even where the file named outside exists."""
    name = "model.layers.0.mlp.up_proj.weight"
    stray = tmp_path / "stray.safetensors"  # a valid shard, beside the checkpoint directory
    shutil.copy(sharded / json.loads((sharded / INDEX_FILE).read_text())["weight_map"][name], stray)
    named = str(stray) if outside == "absolute" else "../stray.safetensors"
    _rewrite_index(sharded, lambda weight_map: weight_map.update({name: named}))
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: names shard {re.escape(repr(named))}, outside the"):
        load_model(sharded)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"])
def test_tokenizer_file_that_does_not_parse_is_named(tmp_path, name):
    build_byte_tokenizer().save_pretrained(tmp_path)
    (tmp_path / name).write_text("{")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path / name))}: not valid JSON"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "name, hint",
    [
        ("tiny-lama", "Did you mean 'tiny-llama'?"),
        ("meta-llama/Llama-3-8B", "looks like a Hugging Face Hub id: download it first"),
        ("/no/such/checkpoint", ""),
    ],
)
def test_a_name_that_is_no_model_lists_the_built_in_ones_and_says_nothing_is_downloaded(name, hint):
    for load in (check_model_name, load_named_model):
        with pytest.raises(ValueError, match=re.escape(f"model {name!r} is neither a built-in model")) as info:
            load(name)
        message = str(info.value)
        assert all(builtin in message for builtin in BUILTIN_MODELS)
        assert "local checkpoint directories only and downloads nothing" in message and hint in message


def test_truncated_file_names_the_file(single):
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_model(single)


def test_header_that_is_not_json_names_the_file(single):
    path = single / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("#")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*not valid JSON"):
        load_model(single)


def test_index_naming_a_missing_shard_names_the_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (sharded / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_model(sharded)


def test_missing_tensor_is_named(single):
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensors(single / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_model(single)


def test_unexpected_tensor_is_named(single):
    rewrite_tensors(single / "model.safetensors", lambda t: t.update(extra=np.ones(3, np.float32)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'extra'"):
        load_model(single)


def test_shape_mismatch_names_the_tensor_and_file(single):
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite_tensors(single / "model.safetensors", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{re.escape(name)}.*shape"):
        load_model(single)


def test_unsupported_rope_type_is_named():
    hf_config = tiny_hf_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        TransformerConfig.from_hf(hf_config)


@pytest.mark.parametrize(
    ("arch", "overrides", "field"),
    [
        ("gemma2", {"hidden_activation": "relu"}, "hidden_act"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_unsupported_fields_are_named(arch, overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig.from_hf(tiny_hf_config(arch, **overrides))


def test_a_quantization_method_not_read_is_refused_naming_it():
    """FP8 checkpoints load (``tests/test_fp8_weights.py``); integer ones are refused by name."""
    hf_config = tiny_hf_config("llama", quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported: jaxrunner reads FP8"):
        TransformerConfig.from_hf(hf_config)


def test_a_fused_tensor_of_the_wrong_length_is_named(tmp_path):
    save_tiny_hf_model("phi3", tmp_path)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    rewrite_tensors(tmp_path / "model.safetensors", lambda t: t.update({name: t[name][:-16]}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{re.escape(name)}.*rows"):
        load_model(tmp_path)


def test_qwen_sliding_window_only_when_enabled():
    off = TransformerConfig.from_hf(tiny_hf_config("qwen2", sliding_window=6))
    on = TransformerConfig.from_hf(
        tiny_hf_config("qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=2)
    )
    assert off.sliding_window is None and off.layer_sliding_window(2) is None
    assert [on.layer_sliding_window(i) for i in range(3)] == [None, None, 6]


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.int32],
)
def test_reader_matches_the_safetensors_library(dtype, tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {
        "a": (torch.randn(3, 5) * 100).to(dtype),
        "b": torch.arange(7).to(dtype),
        "scalar": torch.ones(()).to(dtype),
    }
    safetensors.torch.save_file(tensors, path)
    ours = dict(iter_tensors(path))
    assert ours.keys() == tensors.keys()
    for name, ref in tensors.items():
        np.testing.assert_array_equal(ours[name].astype(np.float64), ref.to(torch.float64).numpy())


def test_llm_names_a_broken_config_and_an_unknown_model_before_building_anything(single):
    from jaxrunner import LLM

    config_path = single / "config.json"
    config_path.write_text("{")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(config_path))}: not valid JSON"):
        LLM(str(single))
    with pytest.raises(ValueError, match=r"neither a built-in model.*tiny-llama"):
        LLM("tiny-lama")
