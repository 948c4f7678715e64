"""Multi-LoRA on the device: every adapter slot's A and B for each projection, and the batched product.

Each of the ``max_loras`` slots holds one adapter (or zeros); each token names its
slot (-1: the base model alone). A projection ``W`` then computes, for every token
``t`` of slot ``s``, ``W x_t + B_s A_s x_t`` with the adapter's scaling folded into
``B`` (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` for rsLoRA). The product is dense
over slots: ``x`` times every slot's ``A`` at once, the tokens' one-hot slot mask,
then every slot's ``B`` at once. Two matmuls of static shape whatever the batch
mixes, so one program serves any assignment of adapters to tokens and nothing
compiles when adapters are loaded or swapped. Ranks below ``max_lora_rank`` are
zero-padded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by HF's names."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """Every slot's adapter weights, per module: ``a`` ``[num_layers, max_loras, in_features, max_lora_rank]``,
    ``b`` ``[num_layers, max_loras, max_lora_rank, out_features]``."""

    a: dict[str, Float[Array, "num_layers max_loras in_features max_lora_rank"]]
    b: dict[str, Float[Array, "num_layers max_loras max_lora_rank out_features"]]

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        shapes: Mapping[str, tuple[int, int]],
        max_loras: int,
        max_lora_rank: int,
        dtype,
    ) -> LoRAWeights:
        """Empty slots for the modules of ``shapes`` (``(in_features, out_features)`` by name, as
        ``TransformerConfig.projection_shapes`` gives): every token's product is zero until an adapter is set."""
        lead = (num_layers, max_loras)
        modules = [m for m in LORA_MODULES if m in shapes]
        return cls(
            a={m: jnp.zeros((*lead, shapes[m][0], max_lora_rank), dtype) for m in modules},
            b={m: jnp.zeros((*lead, max_lora_rank, shapes[m][1]), dtype) for m in modules},
        )

    @property
    def max_loras(self) -> int:
        return next(iter(self.a.values())).shape[1]

    @property
    def max_lora_rank(self) -> int:
        return next(iter(self.a.values())).shape[3]


def adapter_arrays(
    weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]], like: LoRAWeights
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One adapter's ``(layer, module) -> (a [in, r], b [r, out])`` as the arrays of one slot of
    ``like``, per module: ``a`` ``[num_layers, in_features, max_lora_rank]``, ``b`` ``[num_layers,
    max_lora_rank, out_features]``; zero where the adapter has no weights and past its rank."""
    a = {m: np.zeros(w.shape[:1] + w.shape[2:], np.float32) for m, w in like.a.items()}
    b = {m: np.zeros(w.shape[:1] + w.shape[2:], np.float32) for m, w in like.b.items()}
    for (layer, module), (a_part, b_part) in weights.items():
        rank = a_part.shape[1]
        a[module][layer, :, :rank] = a_part
        b[module][layer, :rank] = b_part
    return a, b


@jax.jit
def set_slot(
    weights: LoRAWeights,
    slot: Int[Array, ""],
    a: Mapping[str, Float[Array, "num_layers in_features max_lora_rank"]],
    b: Mapping[str, Float[Array, "num_layers max_lora_rank out_features"]],
) -> LoRAWeights:
    """``weights`` with slot ``slot`` holding ``a`` and ``b`` (a traced slot: one program for every slot)."""

    def put(stacked, one):
        return jax.lax.dynamic_update_index_in_dim(stacked, one.astype(stacked.dtype), slot, axis=1)

    return LoRAWeights(
        a={m: put(weights.a[m], a[m]) for m in weights.a},
        b={m: put(weights.b[m], b[m]) for m in weights.b},
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRALayer:
    """One layer's slots and the step's tokens' slot mask, what the layer's projections add with."""

    a: dict[str, Float[Array, "max_loras in_features max_lora_rank"]]
    b: dict[str, Float[Array, "max_loras max_lora_rank out_features"]]
    token_mask: Float[Array, "num_tokens max_loras"]

    def delta(
        self, module: str, x: Float[Array, "num_tokens in_features"]
    ) -> Float[Array, "num_tokens out_features"] | None:
        """``B_s A_s x_t`` for each token ``t`` of slot ``s`` (zero for the base model's tokens);
        None where no slot holds weights for ``module``."""
        if module not in self.a:
            return None
        a, b = self.a[module].astype(x.dtype), self.b[module].astype(x.dtype)
        shrunk = jnp.einsum("ti,sir->tsr", x, a, preferred_element_type=jnp.float32)
        shrunk = (shrunk * self.token_mask[:, :, None]).astype(x.dtype)
        return jnp.einsum("tsr,sro->to", shrunk, b, preferred_element_type=jnp.float32).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What a step's model call needs for LoRA: the slots' weights and each token's slot (-1: none)."""

    weights: LoRAWeights
    token_slots: Int[Array, " num_tokens"]

    def layer(self, index: int) -> LoRALayer:
        mask = self.token_slots[:, None] == jnp.arange(self.weights.max_loras, dtype=self.token_slots.dtype)
        return LoRALayer(
            a={m: w[index] for m, w in self.weights.a.items()},
            b={m: w[index] for m, w in self.weights.b.items()},
            token_mask=mask.astype(jnp.float32),
        )


def with_lora(
    y: Float[Array, "num_tokens ..."], lora: LoRALayer | None, module: str, x: Float[Array, "num_tokens in_features"]
) -> Float[Array, "num_tokens ..."]:
    """``y`` (the base projection of ``x``, any shape with the projection's outputs flattened last)
    plus ``module``'s LoRA product, when ``lora`` holds weights for it."""
    delta = None if lora is None else lora.delta(module, x)
    return y if delta is None else y + delta.reshape(y.shape)
