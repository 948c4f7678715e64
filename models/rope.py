"""Rotary position embeddings: the inverse frequencies of each scaling HF configs name, read from a config.

A scaling is chosen when the model is loaded, never per step, so every step of a
request reads the same angles (as vLLM's; transformers re-picks LongRoPE's factors
from the current sequence length instead, so the two agree up to
``original_max_position_embeddings``).
"""

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent scaling (HF ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Positions divided by ``factor`` (HF ``rope_type: linear``; Gemma 3's global layers)."""

    factor: float


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE (HF ``rope_type: longrope``, formerly ``su``): one divisor per frequency, and cos/sin
    multiplied by ``attention_factor``.

    ``factors`` are the config's ``long_factor`` when the served length exceeds
    ``original_max_position_embeddings``, else its ``short_factor`` (vLLM's choice).
    """

    factors: tuple[float, ...]
    attention_factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling | LongRopeScaling

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")
"""The HF ``rope_type`` values read here."""


@dataclasses.dataclass(frozen=True)
class Rope:
    """One RoPE: base ``theta`` and an optional scaling."""

    theta: float = 10000.0
    scaling: RopeScaling | None = None

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The ``head_dim / 2`` inverse frequencies (float32), scaled."""
        exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
        inv_freq = (1.0 / self.theta**exponents).astype(np.float32)
        s = self.scaling
        if isinstance(s, LinearRopeScaling):
            return (inv_freq / np.float32(s.factor)).astype(np.float32)
        if isinstance(s, LongRopeScaling):
            if len(s.factors) != head_dim // 2:
                raise ValueError(f"LongRoPE has {len(s.factors)} factors; head_dim {head_dim} needs {head_dim // 2}")
            return (1.0 / (np.asarray(s.factors, np.float32) * self.theta**exponents)).astype(np.float32)
        if isinstance(s, Llama3RopeScaling):
            return _llama3_inv_freq(inv_freq, s)
        return inv_freq

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (LongRoPE's magnitude correction; 1 otherwise)."""
        return self.scaling.attention_factor if isinstance(self.scaling, LongRopeScaling) else 1.0


def _llama3_inv_freq(inv_freq: np.ndarray, s: Llama3RopeScaling) -> np.ndarray:
    """Long wavelengths slowed by ``factor``, short ones kept, the band in between interpolated."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    scaled = np.where((wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen), interpolated, scaled)
    return scaled.astype(np.float32)


def rope_params(hf_config: Any) -> dict:
    """``rope_parameters`` (transformers 5), or the older ``rope_scaling``; empty where neither is set."""
    return dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})


def rope_from_params(params: dict, hf_config: Any, max_model_len: int | None = None) -> Rope:
    """The RoPE one ``rope_parameters`` dict describes (theta falling back to the config's ``rope_theta``).

    ``max_model_len`` (None: the config's ``max_position_embeddings``) picks LongRoPE's
    long or short factors. An unknown ``rope_type`` or a partial rotary factor is
    refused, naming the field.
    """
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"rope_parameters.partial_rotary_factor {params['partial_rotary_factor']} is not supported (only 1.0)"
        )
    if rope_type == "default":
        return Rope(theta)
    if rope_type == "linear":
        return Rope(theta, LinearRopeScaling(float(params["factor"])))
    if rope_type == "llama3":
        return Rope(
            theta,
            Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            ),
        )
    if rope_type in ("longrope", "su"):
        return Rope(theta, _long_rope(params, hf_config, max_model_len))
    raise ValueError(
        f"rope_parameters.rope_type {rope_type!r} is not supported (supported: {', '.join(map(repr, ROPE_TYPES))})"
    )


def _long_rope(params: dict, hf_config: Any, max_model_len: int | None) -> LongRopeScaling:
    """LongRoPE's factors for ``max_model_len`` and its attention factor, as transformers and vLLM derive it."""
    original = int(params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
    max_positions = int(hf_config.max_position_embeddings)
    served = max_positions if max_model_len is None else max_model_len
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = params["long_factor"] if served > original else params["short_factor"]
    return LongRopeScaling(tuple(float(f) for f in factors), float(attention_factor))
