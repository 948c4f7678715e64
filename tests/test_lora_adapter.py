"""PEFT LoRA adapters read without torch: ``x @ a @ b`` is PEFT's own delta, and bad adapters are refused by name.

PEFT (torch, CPU) is the oracle: each adapter is a random ``get_peft_model`` of a
tiny HF model, saved with ``save_pretrained``; the delta a LoRA-wrapped Linear adds
is its output minus its base layer's output.
"""

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import safetensors.torch
import torch
import transformers

from jaxrunner.models import TransformerConfig
from jaxrunner.models.lora import LORA_MODULES
from jaxrunner.models.lora_adapter import LoRAAdapter, LoRAAdapterError, read_lora_adapter

_SHAPE: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, dtype="float32"
)
HF_CONFIGS = {
    "llama": transformers.LlamaConfig(**_SHAPE, intermediate_size=128, num_key_value_heads=2),
    "qwen2": transformers.Qwen2Config(**_SHAPE, intermediate_size=96, num_key_value_heads=1),
}
ADAPTERS = {  # name -> (base, LoraConfig arguments)
    "llama_r8": ("llama", dict(r=8, lora_alpha=16, target_modules=list(LORA_MODULES))),
    "qwen2_r16": ("qwen2", dict(r=16, lora_alpha=8, target_modules=list(LORA_MODULES))),
    "rslora": ("llama", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=list(LORA_MODULES))),
    "patterns": (
        "qwen2",
        dict(
            r=8,
            lora_alpha=16,
            target_modules=list(LORA_MODULES),
            rank_pattern={"q_proj": 4},
            alpha_pattern={"o_proj": 3},
        ),
    ),
    "layer_1": (
        "llama",
        dict(
            r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"], layers_to_transform=[1], layers_pattern="layers"
        ),
    ),
    "regex": ("qwen2", dict(r=8, lora_alpha=16, target_modules=r".*\.(k_proj|up_proj)", exclude_modules=r".*\.0\..*")),
}
MAX_RANK = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, peft.PeftModel]]:
    """Each adapter of ``ADAPTERS`` on a seeded random base, saved to its own directory, with its PEFT model."""
    root = tmp_path_factory.mktemp("adapters")
    models = {}
    for seed, (name, (base, lora_args)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[base])
        peft_model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora_args)).eval()
        peft_model.save_pretrained(root / name)
        models[name] = (root / name, peft_model)
    return models


def _config(base: str, **overrides) -> TransformerConfig:
    return TransformerConfig.from_hf(HF_CONFIGS[base].__class__(**{**HF_CONFIGS[base].to_dict(), **overrides}))


def _peft_deltas(peft_model: peft.PeftModel, x: np.ndarray) -> dict[tuple[int, str], np.ndarray]:
    """``(layer, module) -> W'x - Wx`` of every LoRA-wrapped Linear, PEFT's forward itself."""
    deltas = {}
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if isinstance(module, peft.tuners.lora.Linear):
                layer, module_name = re.fullmatch(r".*\.layers\.(\d+)\.\w+\.(\w+)", name).groups()  # type: ignore[union-attr]
                xs = torch.from_numpy(x[:, : module.in_features])
                deltas[int(layer), module_name] = (module(xs) - module.base_layer(xs)).numpy()
    return deltas


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_factors_give_peft_delta(saved, name):
    path, peft_model = saved[name]
    base = ADAPTERS[name][0]
    adapter = read_lora_adapter(name, path, _config(base), MAX_RANK)
    x = np.random.default_rng(0).standard_normal((5, 128), dtype=np.float32)
    deltas = _peft_deltas(peft_model, x)
    assert adapter.weights.keys() == deltas.keys()
    shapes = _config(base).projection_shapes()
    for (layer, module), (a, b) in adapter.weights.items():
        in_features, out_features = shapes[module]
        assert a.shape == (in_features, adapter.rank) and b.shape == (adapter.rank, out_features)
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_allclose(x[:, :in_features] @ a @ b, deltas[layer, module], rtol=1e-5, atol=1e-5)


def test_targets_follow_peft_config(saved):
    """rsLoRA's scaling, per-module ranks padded to the largest, and the layer and regex selections."""
    rslora = read_lora_adapter("rslora", saved["rslora"][0], _config("llama"), MAX_RANK)
    lora_b = saved["rslora"][1].base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    np.testing.assert_allclose(rslora.weights[0, "q_proj"][1], lora_b.detach().numpy().T * 8 / 16**0.5, rtol=1e-6)
    patterns = read_lora_adapter("patterns", saved["patterns"][0], _config("qwen2"), MAX_RANK)
    assert patterns.rank == 8 and not patterns.weights[0, "q_proj"][0][:, 4:].any()
    layer_1 = read_lora_adapter("layer_1", saved["layer_1"][0], _config("llama"), MAX_RANK)
    assert sorted(layer_1.weights) == [(1, "down_proj"), (1, "q_proj")]
    regex = read_lora_adapter("regex", saved["regex"][0], _config("qwen2"), MAX_RANK)
    assert sorted(regex.weights) == [(1, "k_proj"), (1, "up_proj")]


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _edit_tensors(edit_dict: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        tensors = safetensors.torch.load_file(path / "adapter_model.safetensors")
        edit_dict(tensors)
        safetensors.torch.save_file(tensors, path / "adapter_model.safetensors")

    return edit


_Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


def _to_torch_pickle(path: Path) -> None:
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")


def _replace_by_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_text("")


def _truncate(path: Path) -> None:
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 4)


REFUSALS: dict[str, tuple[Callable[[Path], None], str]] = {  # case -> (edit of a good adapter, message fragment)
    "not_lora": (_edit_config(peft_type="LOHA"), "peft_type 'LOHA'"),
    "bias": (_edit_config(bias="all"), "bias 'all'"),
    "modules_to_save": (_edit_config(modules_to_save=["lm_head"]), "modules_to_save=['lm_head']"),
    "fan_in_fan_out": (_edit_config(fan_in_fan_out=True), "fan_in_fan_out=True"),
    "dora": (_edit_config(use_dora=True), "use_dora=True"),
    "pissa": (_edit_config(init_lora_weights="pissa"), "path_initial_model_for_weight_conversion"),
    "lm_head": (_edit_config(target_modules=["q_proj", "lm_head"]), "targets ['lm_head']"),
    "embed_tokens": (_edit_config(target_modules=["embed_tokens"]), "targets ['embed_tokens']"),
    "lm_head_regex": (_edit_config(target_modules=r".*(q_proj|lm_head)"), "targets ['lm_head']"),
    "untargeted_tensors": (_edit_config(target_modules=["q_proj"]), "does not target"),
    "rank_mismatch": (_edit_config(r=4), "shape (8, 128), but rank 4 on the base model's down_proj"),
    "no_target": (_edit_config(layers_to_transform=[5]), "targets no module of the base model's 2 layers"),
    "bad_regex": (_edit_config(target_modules="q_proj("), "invalid regex 'q_proj('"),
    "missing_b": (_edit_tensors(lambda t: t.__delitem__(f"{_Q_PROJ}.lora_B.weight")), "lacks lora_B of model.layers.0"),
    "unknown_tensor": (
        _edit_tensors(lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})),
        "holds 'base_model.model.lm_head.lora_A.weight', which is not a LoRA factor",
    ),
    "int_tensor": (
        _edit_tensors(lambda t: t.update({f"{_Q_PROJ}.lora_A.weight": torch.zeros(8, 64, dtype=torch.int32)})),
        "of dtype int32, not a float dtype",
    ),
    "not_a_directory": (_replace_by_file, "is not a directory"),
    "no_config": (lambda p: (p / "adapter_config.json").unlink(), "has no adapter_config.json"),
    "no_weights": (lambda p: (p / "adapter_model.safetensors").unlink(), "has no adapter_model.safetensors"),
    "torch_pickle": (_to_torch_pickle, "safe_serialization=True"),
    "truncated": (_truncate, "too short"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_adapter_refused_by_name(saved, tmp_path, case):
    edit, fragment = REFUSALS[case]
    path = Path(shutil.copytree(saved["llama_r8"][0], tmp_path / "adapter"))
    edit(path)
    with pytest.raises(LoRAAdapterError, match=re.escape(f"LoRA adapter 'bad' at {path}: ")) as error:
        read_lora_adapter("bad", path, _config("llama"), MAX_RANK)
    assert fragment in str(error.value)


@pytest.mark.parametrize(
    "base_overrides, max_rank, fragment",
    [
        (dict(num_hidden_layers=1), MAX_RANK, "of layer 1, but the base model has 1 layers"),
        (dict(intermediate_size=96), MAX_RANK, "shape (8, 128), but rank 8 on the base model's down_proj (96 -> 64)"),
        (dict(num_key_value_heads=4), MAX_RANK, "shape (32, 8), but rank 8 on the base model's k_proj (64 -> 64)"),
        ({}, 4, "rank 8, above max_lora_rank 4; raise max_lora_rank to 8"),
    ],
)
def test_adapter_not_fitting_base_refused(saved, base_overrides, max_rank, fragment):
    path = saved["llama_r8"][0]
    with pytest.raises(LoRAAdapterError, match=re.escape(f"LoRA adapter 'llama_r8' at {path}: ")) as error:
        read_lora_adapter("llama_r8", path, _config("llama", **base_overrides), max_rank)
    assert fragment in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_default_names_read_as_float32(saved, tmp_path, dtype):
    """16-bit factors under PEFT's in-memory names (``lora_A.default.weight``) read as their float32 values."""
    path = Path(shutil.copytree(saved["llama_r8"][0], tmp_path / "adapter"))
    tensors = safetensors.torch.load_file(path / "adapter_model.safetensors")
    renamed = {k.replace(".weight", ".default.weight"): v.to(dtype) for k, v in tensors.items()}
    safetensors.torch.save_file(renamed, path / "adapter_model.safetensors")
    adapter: LoRAAdapter = read_lora_adapter("half", path, _config("llama"), MAX_RANK)
    a, b = adapter.weights[1, "v_proj"]
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    np.testing.assert_array_equal(a, tensors[f"{prefix}.lora_A.weight"].to(dtype).float().numpy().T)
    np.testing.assert_array_equal(b, tensors[f"{prefix}.lora_B.weight"].to(dtype).float().numpy().T * np.float32(2))
