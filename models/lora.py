"""Multi-LoRA on the device: every adapter slot's A and B for each merged projection, and the batched product.

Each of the ``max_loras`` slots holds one adapter (or zeros); each token names its
slot (-1: the base model alone). A projection ``W`` then computes, for every token
``t`` of slot ``s``, ``W x_t + B_s A_s x_t`` with the adapter's scaling folded into
``B`` (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` for rsLoRA).

The product is dense over slots and over the modules of one merged projection
(``LORA_GROUPS``: q/k/v, gate/up, which read the same input): ``x`` times every
slot's and module's ``A`` at once (``A`` stored ``[module, slot, rank, in]``, one
matmul contracting the last axes of both, which at one row ran in half the time
of ``[in, ...]``: ``benchmarks/decisions/lora_product.md``), the tokens' one-hot
slot mask, then every slot's ``B`` at once (stored block-diagonal over modules,
``[module, slot, rank, out]``, one matmul whose output holds every module's
columns). Two matmuls of static shape per merged projection,
whatever the batch mixes: one program serves any assignment of adapters to tokens
and nothing compiles when adapters are loaded or swapped. Ranks below
``max_lora_rank`` are zero-padded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""The model's projections that carry LoRA, each with the HF Linears (modules) it merges, in order."""
LORA_MODULES = tuple(module for modules in LORA_GROUPS.values() for module in modules)
"""The projections an adapter may target, by HF's names."""
A_SLOT_AXIS = 1
"""The slot axis of ``LoRAWeights.a``'s arrays, ``[modules, max_loras, max_lora_rank, in_features]``."""
B_SLOT_AXIS = 1
"""The slot axis of ``LoRAWeights.b``'s arrays, ``[modules, max_loras, max_lora_rank, out_features]``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """Every slot's adapter weights, per merged projection (``LORA_GROUPS``' keys) and layer: ``a``
    ``[modules, max_loras, max_lora_rank, in_features]`` and ``b`` ``[modules, max_loras, max_lora_rank,
    out_features]``, whose ``out_features`` are every module's outputs one after another and each module's
    rows are zero outside its own columns. One array per layer, so that a layer's matmuls read it whole
    (a slice of a stack of layers would be copied out first)."""

    a: dict[str, list[Float[Array, "modules max_loras max_lora_rank in_features"]]]
    b: dict[str, list[Float[Array, "modules max_loras max_lora_rank out_features"]]]
    widths: tuple[tuple[str, int], ...] = dataclasses.field(metadata=dict(static=True))
    """Each module's ``out_features``, by name: where its columns lie in its projection's ``b``."""

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        shapes: Mapping[str, tuple[int, int]],
        max_loras: int,
        max_lora_rank: int,
        dtype,
    ) -> LoRAWeights:
        """Empty slots for the merged projections whose modules ``shapes`` has (``(in_features,
        out_features)`` by module, as ``TransformerConfig.projection_shapes`` gives): every token's
        product is zero until an adapter is set."""
        a, b = {}, {}
        for group, modules in _groups(shapes).items():
            in_features, outputs = shapes[modules[0]][0], sum(shapes[m][1] for m in modules)
            a_shape = (len(modules), max_loras, max_lora_rank, in_features)
            a[group] = [jnp.zeros(a_shape, dtype) for _ in range(num_layers)]
            b[group] = [jnp.zeros((len(modules), max_loras, max_lora_rank, outputs), dtype) for _ in range(num_layers)]
        widths = tuple((m, shapes[m][1]) for modules in _groups(shapes).values() for m in modules)
        return cls(a=a, b=b, widths=widths)

    @property
    def max_loras(self) -> int:
        return next(iter(self.a.values()))[0].shape[A_SLOT_AXIS]

    def one_slot(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The shapes of one slot's ``a`` and ``b`` arrays of every layer (what ``adapter_arrays`` makes)."""
        drop = lambda layers, axis: (len(layers), *layers[0].shape[:axis], *layers[0].shape[axis + 1 :])
        return (
            {g: drop(w, A_SLOT_AXIS) for g, w in self.a.items()},
            {g: drop(w, B_SLOT_AXIS) for g, w in self.b.items()},
        )


def _groups(shapes: Mapping[str, tuple[int, int]]) -> dict[str, tuple[str, ...]]:
    return {group: modules for group, modules in LORA_GROUPS.items() if all(m in shapes for m in modules)}


def adapter_arrays(
    weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]], like: LoRAWeights
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One adapter's ``(layer, module) -> (a [in, r], b [r, out])`` as one slot of ``like`` (float32):
    per merged projection, ``a`` ``[num_layers, modules, max_lora_rank, in_features]`` and ``b``
    ``[num_layers, modules, max_lora_rank, out_features]``, each module's ``b`` in its own columns; zero
    where the adapter has no weights and past its rank."""
    a_shapes, b_shapes = like.one_slot()
    a = {g: np.zeros(shape, np.float32) for g, shape in a_shapes.items()}
    b = {g: np.zeros(shape, np.float32) for g, shape in b_shapes.items()}
    for (layer, module), (a_part, b_part) in weights.items():
        group, index, columns = _place(like, module)
        rank = a_part.shape[1]
        a[group][layer, index, :rank, :] = a_part.T
        b[group][layer, index, :rank, columns] = b_part
    return a, b


def _place(weights: LoRAWeights, module: str) -> tuple[str, int, slice]:
    """``module``'s merged projection, its index among that projection's modules, and its output columns."""
    group = next(g for g, modules in LORA_GROUPS.items() if module in modules)
    widths = dict(weights.widths)
    index = LORA_GROUPS[group].index(module)
    start = sum(widths[m] for m in LORA_GROUPS[group][:index])
    return group, index, slice(start, start + widths[module])


@jax.jit
def set_slot(
    weights: LoRAWeights,
    slot: Int[Array, ""],
    a: Mapping[str, Float[Array, "num_layers modules max_lora_rank in_features"]],
    b: Mapping[str, Float[Array, "num_layers modules max_lora_rank out_features"]],
) -> LoRAWeights:
    """``weights`` with slot ``slot`` holding ``a`` and ``b`` (a traced slot: one program for every slot)."""

    def put(stacked, one, axis):
        return jax.lax.dynamic_update_index_in_dim(stacked, one.astype(stacked.dtype), slot, axis=axis)

    return LoRAWeights(
        a={g: [put(w, a[g][i], A_SLOT_AXIS) for i, w in enumerate(layers)] for g, layers in weights.a.items()},
        b={g: [put(w, b[g][i], B_SLOT_AXIS) for i, w in enumerate(layers)] for g, layers in weights.b.items()},
        widths=weights.widths,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRALayer:
    """One layer's slots and the step's tokens' slot mask, what the layer's projections add with."""

    a: dict[str, Float[Array, "modules max_loras max_lora_rank in_features"]]
    b: dict[str, Float[Array, "modules max_loras max_lora_rank out_features"]]
    token_mask: Float[Array, "num_tokens max_loras"]

    def delta(self, group: str, x: Float[Array, "num_tokens in_features"]) -> Float[Array, "num_tokens out_features"]:
        """``B_s A_s x_t`` of every module of ``group`` for each token ``t`` of slot ``s`` (zero for the base
        model's tokens), the modules' outputs one after another."""
        a, b = self.a[group].astype(x.dtype), self.b[group].astype(x.dtype)
        modules, slots, rank, in_features = a.shape
        shrunk = jnp.einsum("ti,ni->tn", x, a.reshape(-1, in_features)).reshape(-1, modules, slots, rank)
        shrunk = shrunk * self.token_mask.astype(x.dtype)[:, None, :, None]
        return jnp.dot(shrunk.reshape(x.shape[0], -1), b.reshape(-1, b.shape[-1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What a step's model call needs for LoRA: the slots' weights and each token's slot (-1: none)."""

    weights: LoRAWeights
    token_slots: Int[Array, " num_tokens"]

    def layer(self, index: int) -> LoRALayer:
        mask = self.token_slots[:, None] == jnp.arange(self.weights.max_loras, dtype=self.token_slots.dtype)
        return LoRALayer(
            a={g: w[index] for g, w in self.weights.a.items()},
            b={g: w[index] for g, w in self.weights.b.items()},
            token_mask=mask.astype(jnp.float32),
        )


def with_lora(
    parts: Sequence[Float[Array, "num_tokens ..."]],
    lora: LoRALayer | None,
    group: str,
    x: Float[Array, "num_tokens in_features"],
) -> list[Float[Array, "num_tokens ..."]]:
    """``parts`` (the base outputs of ``group``'s modules from ``x``, each of any shape with the module's
    outputs flattened last) plus each module's LoRA product, when ``lora`` holds weights for ``group``."""
    if lora is None or group not in lora.a:
        return list(parts)
    delta = lora.delta(group, x)
    bounds = np.cumsum([0] + [int(np.prod(p.shape[1:])) for p in parts])
    return [p + delta[:, lo:hi].reshape(p.shape) for p, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True)]
