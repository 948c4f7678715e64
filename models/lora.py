"""Multi-LoRA on the device: every adapter slot's A and B for each merged projection, and the batched product.

Each of the ``max_loras`` slots holds one adapter (or zeros); each token names its
slot (-1: the base model alone). A projection ``W`` then computes, for every token
``t`` of slot ``s``, ``W x_t + B_s A_s x_t`` with the adapter's scaling folded into
``B`` (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` for rsLoRA).

Every slot's ``A`` lives in the base projection's own kernel, as columns after its
outputs (``add_lora_columns``: the kernel becomes ``[in, outputs + slots * modules
* rank]``), so that one matmul gives the projection and every slot's shrink ``A_s
x`` (one kernel launch; a shrink of its own ran split-K with a reduction after it:
``benchmarks/decisions/lora_product.md``). The tokens' one-hot slot mask keeps
each token's own slot's columns, then one matmul with every slot's ``B`` (stored
``[slot, module, rank, out]``, block-diagonal over the modules of a merged
projection: q/k/v, gate/up) gives every module's outputs at once. Static shapes
whatever the batch mixes: one program serves any assignment of adapters to tokens
and nothing compiles when adapters are loaded or swapped. Ranks below
``max_lora_rank`` are zero-padded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
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
LORA_PARENTS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
"""The decoder layer's submodule that holds each merged projection."""
B_SLOT_AXIS = 0
"""The slot axis of ``LoRAWeights.b``'s arrays, ``[max_loras, modules, max_lora_rank, out_features]``."""

LoRAKernels = dict[tuple[int, str], Float[Array, "in_features kernel_columns"]]
"""The kernels that carry the slots' A, by ``(layer, merged projection)``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """Every slot's B, per merged projection (``LORA_GROUPS``' keys) and layer: ``[max_loras, modules,
    max_lora_rank, out_features]``, whose ``out_features`` are every module's outputs one after another and
    each module's rows are zero outside its own columns. One array per layer, so that a layer's matmul reads
    it whole (a slice of a stack of layers would be copied out first). The slots' A are columns of the base
    kernels (``add_lora_columns``)."""

    b: dict[str, list[Float[Array, "max_loras modules max_lora_rank out_features"]]]
    widths: tuple[tuple[str, int], ...] = dataclasses.field(metadata=dict(static=True))
    """Each module's ``out_features``, by name: where its columns lie in its projection's ``b``."""
    in_features: tuple[tuple[str, int], ...] = dataclasses.field(metadata=dict(static=True))
    """Each merged projection's ``in_features``, by name."""

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
        groups = _groups(shapes)
        b = {}
        for group, modules in groups.items():
            shape = (max_loras, len(modules), max_lora_rank, sum(shapes[m][1] for m in modules))
            b[group] = [jnp.zeros(shape, dtype) for _ in range(num_layers)]
        widths = tuple((m, shapes[m][1]) for modules in groups.values() for m in modules)
        in_features = tuple((g, shapes[modules[0]][0]) for g, modules in groups.items())
        return cls(b=b, widths=widths, in_features=in_features)

    @property
    def max_loras(self) -> int:
        return next(iter(self.b.values()))[0].shape[B_SLOT_AXIS]

    @property
    def max_lora_rank(self) -> int:
        return next(iter(self.b.values()))[0].shape[2]

    def one_slot(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The shapes of one slot's ``a`` and ``b`` arrays of every layer (what ``adapter_arrays`` makes)."""
        in_features = dict(self.in_features)
        b = {g: (len(layers), *layers[0].shape[1:]) for g, layers in self.b.items()}
        a = {g: (*shape[:3], in_features[g]) for g, shape in b.items()}
        return a, b

    def lora_columns(self, group: str) -> int:
        """The columns every slot's A of ``group`` takes in its kernel: slots x modules x rank."""
        return self.max_loras * len(LORA_GROUPS[group]) * self.max_lora_rank


def _groups(shapes: Mapping[str, tuple[int, int]]) -> dict[str, tuple[str, ...]]:
    return {group: modules for group, modules in LORA_GROUPS.items() if all(m in shapes for m in modules)}


def add_lora_columns(model: Any, weights: LoRAWeights) -> None:
    """Append to each LoRA projection's kernel of ``model`` (a ``CausalLM``, in place) zero columns for every
    slot's A of ``weights``, the kernel flattened to ``[in, outputs + columns]``; the projection then adds
    each token's LoRA product (``LoRALayer``). In place, so that the model's weights are never held twice."""
    for layer in model.model.layers:
        for group in weights.b:
            projection = getattr(getattr(layer, LORA_PARENTS[group]), group)
            if projection.lora_group is not None:
                raise ValueError(
                    "The model's projections already carry LoRA columns: one model serves one runner with LoRA "
                    "(load the model again for another)."
                )
            kernel = projection.kernel[...]
            flat = kernel.reshape(kernel.shape[0], -1)
            zeros = jnp.zeros((flat.shape[0], weights.lora_columns(group)), flat.dtype)
            projection.kernel.set_value(jnp.concatenate([flat, zeros], axis=1))
            projection.lora_group = group


def lora_kernel_leaves(params: nnx.State) -> dict[tuple[int, str], int]:
    """The index, among ``jax.tree.leaves(params)``, of each LoRA projection's kernel, by ``(layer, group)``."""
    indices = {}
    for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if len(keys) >= 5 and keys[-5] == "layers" and keys[-1] == "kernel" and keys[-2] in LORA_GROUPS:
            if keys[-3] == LORA_PARENTS[keys[-2]]:
                indices[(int(keys[-4]), str(keys[-2]))] = index
    return indices


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


def set_slot(
    kernels: LoRAKernels,
    weights: LoRAWeights,
    slot: Int[Array, ""],
    a: Mapping[str, Float[Array, "num_layers modules max_lora_rank in_features"]],
    b: Mapping[str, Float[Array, "num_layers modules max_lora_rank out_features"]],
) -> tuple[LoRAKernels, LoRAWeights]:
    """``kernels`` and ``weights`` with slot ``slot`` holding ``a`` and ``b`` (a traced slot: one program for
    every slot). A slot's A columns are its modules' ranks, after the slots before it."""
    new_kernels = {}
    for (layer, group), kernel in kernels.items():
        one = a[group][layer]  # [modules, rank, in]
        width = one.shape[0] * one.shape[1]
        start = kernel.shape[1] - weights.lora_columns(group) + slot * width
        columns = one.reshape(width, -1).T.astype(kernel.dtype)
        new_kernels[(layer, group)] = jax.lax.dynamic_update_slice(kernel, columns, (0, start))

    def put(stacked, one):
        return jax.lax.dynamic_update_index_in_dim(stacked, one.astype(stacked.dtype), slot, axis=B_SLOT_AXIS)

    new_b = {g: [put(w, b[g][i]) for i, w in enumerate(layers)] for g, layers in weights.b.items()}
    return new_kernels, dataclasses.replace(weights, b=new_b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRALayer:
    """One layer's slots' B and the step's tokens' slot mask, what the layer's projections add with."""

    b: dict[str, Float[Array, "max_loras modules max_lora_rank out_features"]]
    token_mask: Float[Array, "num_tokens max_loras"]

    def add(
        self,
        group: str,
        parts: Sequence[Float[Array, "num_tokens ..."]],
        shrunk: Float[Array, "num_tokens lora_columns"],
    ) -> list[Float[Array, "num_tokens ..."]]:
        """``parts`` (the base outputs of ``group``'s modules, each of any shape with the module's outputs
        flattened last) plus ``B_s`` times each token's own slot's shrink (``shrunk``: every slot's ``A_s
        x_t``, the columns after the projection's outputs); zero for the base model's tokens."""
        b = self.b[group].astype(shrunk.dtype)
        num_tokens, slots = self.token_mask.shape
        masked = shrunk.reshape(num_tokens, slots, -1) * self.token_mask.astype(shrunk.dtype)[:, :, None]
        delta = jnp.dot(masked.reshape(num_tokens, -1), b.reshape(-1, b.shape[-1]))
        bounds = np.cumsum([0] + [int(np.prod(p.shape[1:])) for p in parts])
        return [p + delta[:, lo:hi].reshape(p.shape) for p, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What a step's model call needs for LoRA: the slots' B and each token's slot (-1: none)."""

    weights: LoRAWeights
    token_slots: Int[Array, " num_tokens"]

    def layer(self, index: int) -> LoRALayer:
        mask = self.token_slots[:, None] == jnp.arange(self.weights.max_loras, dtype=self.token_slots.dtype)
        return LoRALayer(b={g: w[index] for g, w in self.weights.b.items()}, token_mask=mask.astype(jnp.float32))
