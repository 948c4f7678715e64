"""Tiny, randomly initialised HuggingFace models saved to disk: the oracles of the model tests.

``save_tiny_hf_model("llama", tmp_path)`` writes ``config.json`` and safetensors
weights that ``jaxrunner.models.load_model`` reads back; ``hf_logits`` runs the
same checkpoint through transformers (torch float32, CPU) for comparison.
"""

from os import PathLike

import numpy as np
import torch
import transformers

_SHAPE = dict(
    vocab_size=1031,
    hidden_size=128,
    intermediate_size=224,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

# Llama 3 scaling with wavelengths in all three bands (kept, interpolated, slowed) at head_dim 16.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

# LongRoPE at head_dim 16: distinct short and long factors, extended 8x from 64 positions.
_LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    long_factor=[1.0, 1.5, 2.4, 3.9, 6.0, 9.5, 14.0, 20.0],
)
_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary

ARCHS: dict[str, tuple[type[transformers.PretrainedConfig], dict]] = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3": (transformers.LlamaConfig, {"rope_parameters": _LLAMA3_ROPE}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {}),
    "phi3": (
        transformers.Phi3Config,
        {**_SPECIAL_TOKENS, "rope_parameters": _LONGROPE, "original_max_position_embeddings": 64},
    ),
    # Soft caps low enough, and a query scalar other than head_dim, that each shows in the logits.
    "gemma2": (
        transformers.Gemma2Config,
        {
            **_SPECIAL_TOKENS,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),
    # Local layers with their own RoPE base; the global layer's linearly scaled.
    "gemma3": (
        transformers.Gemma3TextConfig,
        {
            **_SPECIAL_TOKENS,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
            },
        },
    ),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Layer 1 dense, the others 64 experts of which 2 are taken, weights not renormalised: steps of up to 8
    # tokens gather each pair's experts, larger ones group the pairs (models/moe.py's unforced choice).
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"num_experts": 64, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "mlp_only_layers": [1]},
    ),
}
"""Preset name -> (HF config class, preset overrides of the shared tiny shape)."""


def tiny_hf_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """The config of a preset (see ``ARCHS``), float32, with ``overrides`` applied last."""
    cls, preset = ARCHS[arch]
    return cls(**{**_SHAPE, **preset, **overrides, "dtype": "float32"})


def save_tiny_hf_model(
    arch: str, path: str | PathLike, *, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> transformers.PretrainedConfig:
    """Builds a seeded random model of preset ``arch`` and ``save_pretrained``s it to ``path``.

    Every parameter is redrawn (norm weights around 1, biases non-zero), so no
    weight mapping is tested against HF's zero or one defaults. ``max_shard_size``
    (e.g. ``"100KB"``) saves a sharded checkpoint with an index.
    """
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.08)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return config


def hf_logits(path: str | PathLike, prompts: list[list[int]]) -> list[np.ndarray]:
    """Transformers' float32 logits ``[len(prompt), vocab]`` of each prompt, run one at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]


FP8_MAX = 448.0
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
_FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FP8_FORMATS = {
    # llm-compressor's FP8-dynamic: per-channel weight scales [out, 1], inputs per token at run time.
    "compressed-tensors-dynamic": dict(
        per_channel=True,
        input_scales=False,
        config={
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head"],
        },
    ),
    # llm-compressor's static FP8: one weight scale [1] and one calibrated input scale [1] per Linear.
    "compressed-tensors-static": dict(
        per_channel=False,
        input_scales=True,
        config={
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                }
            },
            "ignore": ["lm_head"],
        },
    ),
    # ModelOpt FP8 (hf_quant_config.json): scalar weight and input scales; the last layer's MLP left out.
    "modelopt": dict(
        per_channel=False,
        input_scales=True,
        hf_quant_config={
            "producer": {"name": "modelopt", "version": "0.19.0"},
            "quantization": {
                "quant_algo": "FP8",
                "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head", "*.2.mlp.*"],
            },
        },
    ),
}
"""Test FP8 checkpoint formats, each as its producer lays out tensors and ``quantization_config``."""


def quantize_fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` in e4m3 with its float32 scales (``[out, 1]`` per channel, ``[1]`` per tensor):
    the largest magnitude of each row (or of all) onto e4m3's largest value, as llm-compressor and vLLM scale."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = torch.clamp(amax / FP8_MAX, min=_MIN_SCALE)
    values = (w / (scale if per_channel else scale[0])).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def save_fp8_checkpoint(source: str | PathLike, out: str | PathLike, fmt: str) -> dict[str, torch.Tensor]:
    """The tiny model saved at ``source`` written to ``out`` with its decoder Linears in FP8 as ``fmt``
    (one of ``FP8_FORMATS``) lays them out; returns the model's float32 state dict with those weights
    dequantized (the same function, for the reference)."""
    import json
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    spec = FP8_FORMATS[fmt]
    source, out = Path(source), Path(out)
    out.mkdir(parents=True)
    state = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    tensors, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        linear = module.rsplit(".", 1)[-1] in _FP8_LINEARS and name.endswith(".weight")
        if not linear or (fmt == "modelopt" and re.search(r"\.2\.mlp\.", module)):
            tensors[name] = dequantized[name] = tensor
            continue
        values, scale = quantize_fp8(tensor, spec["per_channel"])
        tensors[name] = values
        tensors[f"{module}.weight_scale"] = scale.reshape(()) if fmt == "modelopt" else scale
        if spec["input_scales"]:  # a calibrated scale per Linear; any positive value is a valid checkpoint
            input_scale = torch.tensor([0.01 + 0.002 * (len(tensors) % 5)])
            tensors[f"{module}.input_scale"] = input_scale.reshape(()) if fmt == "modelopt" else input_scale
        dequantized[name] = values.float() * (scale if spec["per_channel"] else scale[0])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if "config" in spec:
        config["quantization_config"] = spec["config"]
    else:
        (out / "hf_quant_config.json").write_text(json.dumps(spec["hf_quant_config"]))
    (out / "config.json").write_text(json.dumps(config))
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy2(item, out / item.name)
    return dequantized


def hf_logits_with_state(
    path: str | PathLike, state: dict[str, torch.Tensor], prompts: list[list[int]]
) -> list[np.ndarray]:
    """Transformers' float32 logits of each prompt, of the model saved at ``path`` with ``state`` loaded over
    its weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
