"""Random LoRA adapters in PEFT's format, for models that have no fine-tunes to hand.

The built-in random models have no adapters anyone trained, yet notebooks and
benchmarks need some: this writes ``adapter_config.json`` and
``adapter_model.safetensors`` exactly as PEFT's ``save_pretrained`` would for a
plain LoRA, so PEFT itself loads them and :func:`read_lora_adapter` reads them as
any other adapter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from os import PathLike
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxrunner.models.lora import LORA_MODULES
from jaxrunner.models.lora_adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, hf_module_path
from jaxrunner.models.transformer import TransformerConfig


def save_random_lora_adapter(
    path: str | PathLike,
    config: TransformerConfig,
    *,
    rank: int = 16,
    lora_alpha: float | None = None,
    target_modules: Sequence[str] = LORA_MODULES,
    seed: int = 0,
    b_std: float = 0.02,
    dtype=np.float32,
) -> Path:
    """Write a rank-``rank`` adapter of ``target_modules`` in every layer of a ``config`` model to ``path``.

    ``lora_A`` is drawn with standard deviation ``1 / sqrt(in_features)`` (so ``A x`` is about
    the size of ``x``'s entries) and ``lora_B`` with ``b_std``, which sets how far the adapter
    moves the model; ``lora_alpha`` defaults to ``2 * rank`` (scaling 2). Returns the directory.
    """
    unknown = sorted(set(target_modules) - set(LORA_MODULES))
    if unknown:
        raise ValueError(f"target_modules {unknown} are not LoRA modules; choose among {list(LORA_MODULES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = config.projection_shapes()
    tensors = {}
    for layer in range(config.num_layers):
        for module in target_modules:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.{hf_module_path(layer, module)}"
            a = rng.standard_normal((rank, in_features), np.float32) / np.sqrt(in_features)
            tensors[f"{prefix}.lora_A.weight"] = a.astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_features, rank), np.float32) * b_std).astype(
                dtype
            )
    save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank if lora_alpha is None else lora_alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2))
    return path
