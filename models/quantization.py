"""FP8 weights: the checkpoint formats read, and vLLM's on-load quantization.

A checkpoint's ``quantization_config`` (``config.json``, or ModelOpt's
``hf_quant_config.json``) becomes an :class:`Fp8Config`: which of the decoder's
Linears hold FP8 weights, and how their inputs are scaled. Three formats:

- compressed-tensors (llm-compressor's ``FP8``, ``FP8-dynamic``...): ``float``
  8-bit weights with ``channel`` or ``tensor`` scales, inputs ``dynamic`` per
  token, ``static`` per tensor or not quantized; ``ignore`` lists names and
  ``re:`` patterns.
- ModelOpt: ``quant_algo`` ``FP8`` (per-tensor weight and input scales) or
  ``FP8_PER_CHANNEL_PER_TOKEN``; ``exclude_modules`` are wildcards.
- vLLM's own ``fp8`` (per-tensor weight scales, ``activation_scheme``,
  ``ignored_layers``); ``LLM(quantization="fp8")`` also quantizes a bf16
  checkpoint as it loads, per output channel, inputs per token.

Every Linear keeps HF's tensors: ``weight`` in e4m3, ``weight_scale`` (one value
per tensor or per output), ``input_scale`` where static. Any other format, or a
scheme of these the matmuls do not run (block or group scales, integers), is
refused naming the field.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any

from jaxrunner import envs
from jaxrunner.ops.fp8_matmul import IMPLS

FORMATS = ("compressed-tensors", "modelopt", "fp8")
"""The ``quant_method`` names read (vLLM's): ``fp8`` is also ``LLM(quantization=...)``'s on-load quantization."""

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder layers' Linears, by HF name: those a quantization config may turn to FP8."""

MODELOPT_ALGOS = {"FP8": "static", "FP8_PER_CHANNEL_PER_TOKEN": "dynamic"}
"""ModelOpt's ``quant_algo`` names read, and how each scales the inputs."""


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """FP8 weights in a model's decoder Linears.

    ``activations``: ``"dynamic"`` (inputs quantized per token each step),
    ``"static"`` (by each layer's checkpoint ``input_scale``) or None (weights only:
    the inputs stay in the compute dtype). ``ignored``: HF module names, ``re:``
    regular expressions and ``*`` wildcards of Linears kept unquantized. ``matmul``
    forces one of ``ops.fp8_matmul.IMPLS`` for every bucket (``$JAXRUNNER_FP8_MATMUL``).
    """

    method: str
    activations: str | None
    ignored: tuple[str, ...] = ()
    matmul: str | None = None

    def __post_init__(self) -> None:
        if self.activations not in (None, "dynamic", "static"):
            raise ValueError(f"FP8 activations {self.activations!r}: one of None, 'dynamic', 'static'")
        if self.matmul not in (None, *IMPLS):
            raise ValueError(
                f"FP8 matmul {self.matmul!r} (${envs.FP8_MATMUL_ENV_VAR}) is not one of {', '.join(IMPLS)}"
            )

    def quantizes(self, module: str) -> bool:
        """Whether the Linear ``module`` (its HF name, ``model.layers.0.self_attn.q_proj``) holds FP8 weights."""
        return module.rsplit(".", 1)[-1] in LINEARS and not any(_matches(module, p) for p in self.ignored)

    def quantizes_all(self, modules: list[str]) -> bool:
        """Whether the Linears of one merged projection are FP8; refused where only some are (one matmul)."""
        quantized = {module: self.quantizes(module) for module in modules}
        if len(set(quantized.values())) > 1:
            raise ValueError(
                f"quantization_config quantizes {[m for m, q in quantized.items() if q]} but not "
                f"{[m for m, q in quantized.items() if not q]}: jaxrunner runs these as one matmul, all FP8 or none"
            )
        return all(quantized.values())

    @property
    def static_input_scales(self) -> bool:
        return self.activations == "static"

    def as_dict(self) -> dict[str, Any]:
        """The config as JSON-able fields (a converted model's manifest)."""
        return dict(method=self.method, activations=self.activations, ignored=list(self.ignored))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Fp8Config:
        return cls(fields["method"], fields["activations"], tuple(fields["ignored"]), envs.JAXRUNNER_FP8_MATMUL)


def on_load_fp8() -> Fp8Config:
    """``LLM(quantization="fp8")`` on a checkpoint without FP8 weights: every decoder Linear quantized as it
    loads, per output channel, its inputs per token."""
    return Fp8Config("fp8", "dynamic", (), envs.JAXRUNNER_FP8_MATMUL)


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return fnmatch.fnmatchcase(module, pattern)


def fp8_config_from_hf(quantization: Any) -> Fp8Config | None:
    """The :class:`Fp8Config` of a checkpoint's ``quantization_config`` (None: no quantization)."""
    if not quantization:
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()  # a transformers QuantizationConfigMixin
    method = quantization.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors, "modelopt": _modelopt, "fp8": _vllm_fp8}
    if method not in readers:
        raise ValueError(
            f"quantization_config quant_method {method!r} is not supported: jaxrunner reads FP8 checkpoints "
            f"({', '.join(FORMATS)}); load a bf16 checkpoint (LLM(quantization='fp8') quantizes it to FP8)"
        )
    activations, ignored = readers[method](quantization)
    return Fp8Config(method, activations, tuple(ignored), envs.JAXRUNNER_FP8_MATMUL)


def _compressed_tensors(config: dict[str, Any]) -> tuple[str | None, list[str]]:
    """compressed-tensors: every config group's scheme must be one FP8 scheme the matmuls run."""
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        fmt = group.get("format") or config.get("format")  # newer versions name it per group
        if fmt != "float-quantized":
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported: only 'float-quantized' (FP8 weights)"
            )
        targets = group.get("targets") or []
        if targets != ["Linear"]:
            raise ValueError(f"compressed-tensors config_groups.{name}.targets {targets!r}: only ['Linear']")
        weights = group.get("weights") or {}
        scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if scheme[:2] != ("float", 8) or scheme[2] not in ("channel", "tensor") or weights.get("dynamic"):
            raise ValueError(
                f"compressed-tensors config_groups.{name}.weights (type {scheme[0]!r}, num_bits {scheme[1]!r}, "
                f"strategy {scheme[2]!r}) is not supported: only static 8-bit float weights, 'channel' or "
                "'tensor' scales"
            )
        if group.get("output_activations"):
            raise ValueError(f"compressed-tensors config_groups.{name}.output_activations are not supported")
        schemes.add(_compressed_tensors_inputs(name, group.get("input_activations")))
    if len(schemes) > 1:
        raise ValueError(
            f"compressed-tensors config_groups scale their inputs differently ({sorted(map(str, schemes))})"
        )
    return schemes.pop(), list(config.get("ignore") or [])


def _compressed_tensors_inputs(group: str, inputs: dict[str, Any] | None) -> str | None:
    if not inputs:
        return None
    scheme = (inputs.get("type"), inputs.get("num_bits"), inputs.get("strategy"), bool(inputs.get("dynamic")))
    if scheme == ("float", 8, "token", True):
        return "dynamic"
    if scheme == ("float", 8, "tensor", False):
        return "static"
    raise ValueError(
        f"compressed-tensors config_groups.{group}.input_activations (type {scheme[0]!r}, num_bits {scheme[1]!r}, "
        f"strategy {scheme[2]!r}, dynamic {scheme[3]}) is not supported: only 8-bit float inputs, dynamic per "
        "'token' or static per 'tensor'"
    )


def _modelopt(config: dict[str, Any]) -> tuple[str | None, list[str]]:
    config = config.get("quantization", config)  # hf_quant_config.json nests the fields
    algo = config.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported: only {', '.join(MODELOPT_ALGOS)}")
    return MODELOPT_ALGOS[algo], list(config.get("exclude_modules") or config.get("ignore") or [])


def _vllm_fp8(config: dict[str, Any]) -> tuple[str | None, list[str]]:
    if config.get("weight_block_size"):
        raise ValueError(
            f"fp8 quantization_config weight_block_size {config['weight_block_size']} (block-wise FP8) is not "
            "supported yet: only per-tensor weight scales"
        )
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 quantization_config activation_scheme {scheme!r}: one of 'dynamic', 'static'")
    return scheme, list(config.get("ignored_layers") or [])
