"""Reads a LoRA adapter in PEFT's format into host NumPy arrays, validated against the base model.

PEFT's ``save_pretrained`` writes ``adapter_config.json`` and
``adapter_model.safetensors``, whose tensors are named like
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (``[r, in]``)
and ``...lora_B.weight`` (``[out, r]``). PEFT's forward adds
``(lora_B @ lora_A) x * scaling`` to each targeted Linear; this reader returns
``a = lora_A.T`` and ``b = lora_B.T * scaling``, so the delta is ``x @ a @ b``.
Which modules are targeted, and with which rank and alpha, follows PEFT's own
matching of ``target_modules``, ``exclude_modules``, ``layers_to_transform``,
``layers_pattern``, ``rank_pattern`` and ``alpha_pattern``. Features that change
the forward beyond plain LoRA (DoRA, trained biases, replaced modules, ...) are
refused, as are adapters whose modules or shapes do not fit the base model.
"""

import math
import re
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from jaxtyping import Float32

from jaxrunner.models.lora import LORA_MODULES
from jaxrunner.models.safetensors_io import CheckpointError, iter_tensors, read_json_object
from jaxrunner.models.transformer import TransformerConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_TORCH_WEIGHTS_FILE = "adapter_model.bin"

_PARENT = {m: "self_attn" for m in LORA_MODULES[:4]} | {m: "mlp" for m in LORA_MODULES[4:]}  # module -> its block
_NOT_LORA_ABLE = ("lm_head", "model.embed_tokens")  # a Llama-family model's Linear/Embedding modules beyond those
_ALL_LINEAR = "all-linear"  # PEFT's shorthand for every Linear but the output layer
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16))
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<name>\w+))"
    r"\.lora_(?P<part>[AB])(?:\.default)?\.weight"
)

# Config fields whose non-default value changes PEFT's forward beyond ``W x + (B A x) * scaling``.
_REFUSED_FEATURES = {
    "fan_in_fan_out": "stores weights transposed, as GPT-2's Conv1D layers do",
    "use_dora": "DoRA rescales the adapted weight by a learned magnitude vector",
    "lora_bias": "lora_B carries a bias",
    "modules_to_save": "whole modules (e.g. lm_head) are replaced by trained copies",
    "trainable_token_indices": "embedding rows are trained",
    "alora_invocation_tokens": "aLoRA activates the adapter only after its invocation tokens",
    "use_qalora": "QALoRA pools the input (GPTQ models only)",
    "layer_replication": "base layers are replicated into a deeper model",
    "target_parameters": "raw nn.Parameters are adapted rather than Linear modules",
    "use_bdlora": "BD-LoRA uses block-diagonal factors",
    "arrow_config": "Arrow routes among several adapters",
    "kasa_config": "KaSA truncates the base weights and adds singular values between A and B",
    "monteclora_config": "MonteCLoRA samples the factors",
}
# Initialisations that also rewrite the base weights: the saved factors apply to that rewritten base only.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

LoRAWeights = tuple[Float32[np.ndarray, "in_features rank"], Float32[np.ndarray, "rank out_features"]]


class LoRAAdapterError(ValueError):
    """A LoRA adapter is malformed or does not fit the base model; names the adapter, its path and the fault."""


class _Problem(Exception):
    """What is wrong with the adapter being read; ``read_lora_adapter`` names the adapter around it."""


@dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter's factors, keyed by ``(layer, module)``, each module's scaling folded into ``b``.

    Modules trained at a lower rank than ``rank`` (PEFT's ``rank_pattern``) are zero-padded to it.
    """

    name: str
    path: Path
    rank: int
    weights: dict[tuple[int, str], LoRAWeights]


@dataclass(frozen=True)
class _Target:
    """The rank and scaling PEFT gives one targeted module."""

    rank: int
    scaling: float


def hf_module_path(layer: int, module: str) -> str:
    """The module's name in HF's model, as PEFT matches ``target_modules`` against it."""
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def read_lora_adapter(name: str, path: str | PathLike, config: TransformerConfig, max_lora_rank: int) -> LoRAAdapter:
    """Reads the PEFT LoRA adapter directory ``path`` for a base model of ``config``.

    Raises ``LoRAAdapterError`` if a file is missing or malformed, the adapter uses a feature beyond
    plain LoRA, a rank exceeds ``max_lora_rank``, or its modules or shapes do not fit ``config``.
    """
    path = Path(path)
    try:
        adapter_config = _read_config(path)
        targets = _targets(adapter_config, config)
        rank = max(t.rank for t in targets.values())
        if rank > max_lora_rank:
            raise _Problem(f"has rank {rank}, above max_lora_rank {max_lora_rank}; raise max_lora_rank to {rank}")
        factors = _read_factors(path / ADAPTER_WEIGHTS_FILE, config)
        return LoRAAdapter(name, path, rank, _fold(factors, targets, config, rank))
    except (_Problem, CheckpointError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r} at {path}: {e}") from e


def _read_config(path: Path) -> dict[str, Any]:
    """The adapter directory's config, once both its files are found and the config is plain LoRA."""
    if not path.is_dir():
        raise _Problem("is not a directory; pass the directory PEFT's save_pretrained wrote")
    if not (path / ADAPTER_CONFIG_FILE).is_file():
        raise _Problem(f"has no {ADAPTER_CONFIG_FILE}; pass the directory PEFT's save_pretrained wrote")
    if not (path / ADAPTER_WEIGHTS_FILE).is_file():
        if (path / _TORCH_WEIGHTS_FILE).is_file():
            raise _Problem(
                f"has only {_TORCH_WEIGHTS_FILE} (a torch pickle), which is not read; re-save the adapter with "
                f"save_pretrained(..., safe_serialization=True) to write {ADAPTER_WEIGHTS_FILE}"
            )
        raise _Problem(f"has no {ADAPTER_WEIGHTS_FILE}")
    adapter_config = read_json_object(path / ADAPTER_CONFIG_FILE)
    if adapter_config.get("peft_type") != "LORA":
        raise _Problem(f"{ADAPTER_CONFIG_FILE} has peft_type {adapter_config.get('peft_type')!r}; only 'LORA' is read")
    if adapter_config.get("bias", "none") != "none":
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} has bias {adapter_config['bias']!r}: the base model's biases were trained too, "
            "which is not supported; train with bias='none'"
        )
    for field, reason in _REFUSED_FEATURES.items():
        if adapter_config.get(field):
            raise _Problem(
                f"{ADAPTER_CONFIG_FILE} sets {field}={adapter_config[field]!r} ({reason}), which is not supported; "
                "only plain LoRA adapters are read"
            )
    init = str(adapter_config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_REWRITING_INITS):
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} has init_lora_weights {init!r}, which rewrites the base weights, so the factors "
            "do not apply to the original base model; convert the adapter with "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...)"
        )
    return adapter_config


def _targets(adapter_config: dict[str, Any], config: TransformerConfig) -> dict[tuple[int, str], _Target]:
    """The base model's modules the adapter config targets, each with its rank and scaling, as PEFT decides them."""
    target_modules = _target_modules(adapter_config)
    r: Any = adapter_config.get("r")
    alpha: Any = adapter_config.get("lora_alpha")
    rank_pattern, alpha_pattern = adapter_config.get("rank_pattern") or {}, adapter_config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(isinstance(x, int) and x > 0 for x in [r, *rank_pattern.values()]):
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} needs a positive integer r and rank_pattern values: {r!r}, {rank_pattern!r}"
        )
    alphas = [alpha, *alpha_pattern.values()] if isinstance(alpha_pattern, dict) else [None]
    if not all(isinstance(x, int | float) for x in alphas):
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} needs a numeric lora_alpha and alpha_pattern values: {alpha!r}, {alpha_pattern!r}"
        )
    use_rslora = bool(adapter_config.get("use_rslora", False))
    targets = {}
    for layer in range(config.num_layers):
        for module in LORA_MODULES:
            key = hf_module_path(layer, module)
            if _is_targeted(adapter_config, target_modules, key):
                module_r = rank_pattern.get(_pattern_key(rank_pattern, key), r)
                module_alpha = alpha_pattern.get(_pattern_key(alpha_pattern, key), alpha)
                scaling = module_alpha / math.sqrt(module_r) if use_rslora else module_alpha / module_r
                targets[layer, module] = _Target(module_r, scaling)
    if not targets:
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} targets no module of the base model's {config.num_layers} layers "
            "(check target_modules, exclude_modules, layers_to_transform and layers_pattern)"
        )
    return targets


def _target_modules(adapter_config: dict[str, Any]) -> str | list[str]:
    """The config's ``target_modules`` (a list of names or a regex), checked to target only ``LORA_MODULES``."""
    target_modules = adapter_config.get("target_modules")
    if isinstance(target_modules, str) and target_modules.lower() == _ALL_LINEAR:
        return list(LORA_MODULES)
    if isinstance(target_modules, list) and all(isinstance(t, str) for t in target_modules):
        outside = [t for t in target_modules if t.rsplit(".", 1)[-1] not in LORA_MODULES]
    elif isinstance(target_modules, str):
        outside = [m for m in _NOT_LORA_ABLE if _regex_matches(target_modules, m)]
    else:
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} target_modules must be a list of names or a regex, not {target_modules!r}"
        )
    if outside:
        raise _Problem(
            f"{ADAPTER_CONFIG_FILE} target_modules {target_modules!r} targets {outside}, but only "
            f"{list(LORA_MODULES)} can carry LoRA; retrain the adapter without the others"
        )
    return target_modules


def _is_targeted(adapter_config: dict[str, Any], target_modules: str | list[str], key: str) -> bool:
    """Whether PEFT puts LoRA on the module at ``key``: its ``check_target_module_exists``, module for module."""
    exclude = adapter_config.get("exclude_modules")
    if isinstance(exclude, str) and _regex_matches(exclude, key):
        return False
    if isinstance(exclude, list) and (key in exclude or any(key.endswith(f".{e}") for e in exclude)):
        return False
    if isinstance(target_modules, str):
        return _regex_matches(target_modules, key)
    if key in target_modules:
        return True
    if not any(key.endswith(f".{t}") for t in target_modules):
        return False
    layers = adapter_config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    if not (isinstance(layers, int) or isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise _Problem(f"{ADAPTER_CONFIG_FILE} layers_to_transform must be a layer index or a list of them: {layers!r}")
    patterns = adapter_config.get("layers_pattern") or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    regexes = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in patterns] or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    match = next(filter(None, (_config_regex(r).match(key) for r in regexes)), None)
    if match is None:
        return False
    layer = int(match["idx"])
    return layer == layers if isinstance(layers, int) else layer in layers


def _pattern_key(pattern: dict[str, Any], key: str) -> str:
    """The first key of a PEFT ``rank_pattern``/``alpha_pattern`` that names the module at ``key`` (else ``key``)."""
    return next((p for p in pattern if _config_regex(rf"(.*\.)?({p})$").match(key)), key)


def _regex_matches(regex: str, key: str) -> bool:
    """PEFT's match of a regex ``target_modules``/``exclude_modules`` against a module's full name."""
    return _config_regex(regex).fullmatch(key) is not None


def _config_regex(regex: str) -> re.Pattern[str]:
    """A regex built from the adapter config, compiled; an invalid one is the adapter's fault."""
    try:
        return re.compile(regex)
    except re.error as e:
        raise _Problem(f"{ADAPTER_CONFIG_FILE} holds an invalid regex {regex!r}: {e}") from e


def _read_factors(weights_file: Path, config: TransformerConfig) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    """``(layer, module) -> {"A": lora_A, "B": lora_B}`` from the safetensors file, as float32."""
    factors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor_name, array in iter_tensors(weights_file):
        match = _TENSOR_NAME.fullmatch(tensor_name)
        if match is None or _PARENT.get(match["name"]) != match["parent"]:
            raise _Problem(
                f"{ADAPTER_WEIGHTS_FILE} holds {tensor_name!r}, which is not a LoRA factor of {list(LORA_MODULES)} "
                "(expected names like 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight')"
            )
        layer = int(match["layer"])
        if layer >= config.num_layers:
            raise _Problem(
                f"{ADAPTER_WEIGHTS_FILE} holds {tensor_name!r} of layer {layer}, but the base model has "
                f"{config.num_layers} layers; was the adapter trained for another base model?"
            )
        if array.dtype not in _FLOAT_DTYPES:
            raise _Problem(f"{ADAPTER_WEIGHTS_FILE} holds {tensor_name!r} of dtype {array.dtype}, not a float dtype")
        pair = factors.setdefault((layer, match["name"]), {})
        if match["part"] in pair:
            raise _Problem(f"{ADAPTER_WEIGHTS_FILE} holds lora_{match['part']} of {match['module']} twice")
        pair[match["part"]] = np.asarray(array, dtype=np.float32)
    return factors


def _fold(
    factors: dict[tuple[int, str], dict[str, np.ndarray]],
    targets: dict[tuple[int, str], _Target],
    config: TransformerConfig,
    rank: int,
) -> dict[tuple[int, str], LoRAWeights]:
    """``(a, b)`` of each targeted module: checked against its shape and rank, scaled, zero-padded to ``rank``."""
    if untargeted := sorted(factors.keys() - targets.keys()):
        raise _Problem(
            f"{ADAPTER_WEIGHTS_FILE} holds factors of {len(untargeted)} module(s) that {ADAPTER_CONFIG_FILE} does not "
            f"target, the first {hf_module_path(*untargeted[0])}; the config and the weights disagree"
        )
    shapes = config.projection_shapes()
    weights = {}
    for (layer, module), target in sorted(targets.items()):
        pair = factors.get((layer, module), {})
        where = hf_module_path(layer, module)
        if missing := [f"lora_{p}" for p in "AB" if p not in pair]:
            raise _Problem(
                f"{ADAPTER_WEIGHTS_FILE} lacks {' and '.join(missing)} of {where}, which {ADAPTER_CONFIG_FILE} targets"
            )
        in_features, out_features = shapes[module]
        for part, shape in {"A": (target.rank, in_features), "B": (out_features, target.rank)}.items():
            if pair[part].shape != shape:
                raise _Problem(
                    f"{ADAPTER_WEIGHTS_FILE} has lora_{part} of {where} of shape {pair[part].shape}, but rank "
                    f"{target.rank} on the base model's {module} ({in_features} -> {out_features}) needs {shape}; "
                    "was the adapter trained for another base model, or do its r and rank_pattern not fit its weights?"
                )
        a = np.zeros((in_features, rank), np.float32)
        b = np.zeros((rank, out_features), np.float32)
        a[:, : target.rank] = pair["A"].T
        b[: target.rank] = pair["B"].T * np.float32(target.scaling)
        weights[layer, module] = (a, b)
    return weights
