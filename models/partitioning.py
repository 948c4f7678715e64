"""The logical axes of every model parameter, and the parameters' shardings on a mesh.

``jaxrunner.sharding.ShardingRules`` maps these logical axes to mesh axes.
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxrunner.sharding import RULES, ShardingRules

_LINEAR_AXES = {  # a Linear's kernel is [in, out...]; its bias [out...]
    "qkv_proj": ("embed", "kv_heads", None, "head_dim"),  # [in, kv heads, group + 2, head dim]
    "o_proj": ("q_heads", "embed"),
    "gate_up_proj": ("embed", None, "mlp"),  # [in, 2, intermediate]
    "down_proj": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
    "fc": (None, "embed"),  # EAGLE's projection of (token embedding, feature)
    "gate": ("embed", None),  # a mixture-of-experts router: one logit per expert
}
_FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the Linears that may hold FP8 weights
_NORM_AXES = {
    "input_layernorm": "embed",
    "post_attention_layernorm": "embed",
    "pre_feedforward_layernorm": "embed",
    "post_feedforward_layernorm": "embed",
    "norm": "embed",
    "q_norm": "head_dim",
    "k_norm": "head_dim",
}
PARAM_LOGICAL_AXES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    **{(name, "kernel"): axes for name, axes in _LINEAR_AXES.items()},
    **{(name, "bias"): axes[1:] for name, axes in _LINEAR_AXES.items()},
    **{(name, "weight"): (axis,) for name, axis in _NORM_AXES.items()},
    # FP8 weights keep HF's [*out, in] (models/quantization.py), their scales the bias's axes
    **{(name, "weight"): (*_LINEAR_AXES[name][1:], _LINEAR_AXES[name][0]) for name in _FP8_LINEARS},
    **{(name, "weight_scale"): _LINEAR_AXES[name][1:] for name in _FP8_LINEARS},
    **{(name, "input_scale"): () for name in _FP8_LINEARS},
    ("experts", "gate_up_proj"): ("expert", "embed", None, "mlp"),  # [experts, in, 2, features]
    ("experts", "down_proj"): ("expert", "mlp", "embed"),
    ("self_attn", "k_scale"): (),  # the KV cache scales: one scalar per layer, on every device
    ("self_attn", "v_scale"): (),
}
"""Logical axes of every parameter, by (module name, leaf name)."""


VISION_TOWER = "visual"
"""A vision-language model's vision tower: small beside the decoder, every device holds it whole."""


def logical_axes(path: tuple, ndim: int | None = None) -> tuple[str | None, ...]:
    """The logical axes of the parameter at ``path`` (an nnx path such as ``(..., "qkv_proj", "kernel")``);
    none (replicated) for the vision tower's. A kernel of fewer axes (``ndim``) than its rule names is one
    flattened to ``[in, outputs + LoRA columns]`` (``models/lora.py``): its input axis, outputs whole."""
    if path[0] == VISION_TOWER:
        return ()
    key = (str(path[-2]), str(path[-1]))
    if key not in PARAM_LOGICAL_AXES:
        raise ValueError(f"No sharding rule for parameter {'.'.join(map(str, path))}; add {key} to PARAM_LOGICAL_AXES.")
    axes = PARAM_LOGICAL_AXES[key]
    if ndim is not None and ndim < len(axes) and key[1] == "kernel":
        return (axes[0],) + (None,) * (ndim - 1)
    return axes


def param_sharding(mesh: Mesh, path: tuple, rules: ShardingRules = RULES, ndim: int | None = None) -> NamedSharding:
    """The sharding of the parameter at ``path`` (of ``ndim`` axes, where known) on ``mesh``."""
    return NamedSharding(mesh, rules.spec(logical_axes(path, ndim)))


def param_shardings(mesh: Mesh, params: nnx.State, rules: ShardingRules = RULES) -> nnx.State:
    """A state of ``NamedSharding``s, one per parameter: a prefix of ``params`` for jit and device_put."""
    return nnx.map_state(lambda path, v: param_sharding(mesh, path, rules, ndim=len(v.get_value().shape)), params)
