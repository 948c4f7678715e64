"""Mixture-of-experts layers (Mixtral, Qwen3-MoE): the router, the experts and their grouped matmuls.

A sparse layer's ``mlp`` routes each token to ``top_k`` of ``num_experts`` gated
MLPs and sums their outputs weighted by the router. The router's softmax runs over
every expert in float32; the ``top_k`` largest probabilities are kept, renormalised
to sum to one where the family does (Mixtral always, Qwen3-MoE with
``norm_topk_prob``). The experts' products (:data:`IMPLS`): the (token, expert)
pairs sorted by expert so that each expert multiplies only its own rows
(``ops/grouped_matmul.py``: XLA's ``ragged_dot``, or the Mosaic GPU kernel), or each
pair gathering its expert's matrices (one matrix read a pair: the cheapest while
pairs are few). ``$JAXRUNNER_MOE_IMPL`` forces one; unset (``auto``), each program
picks by its static token count (:func:`pick_impl`): gathered matrices while the
pairs are few against the experts, ``ragged_dot`` beyond.

Checkpoints store one tensor per expert and projection (Mixtral's ``w1``/``w3``/
``w2`` under ``block_sparse_moe``, Qwen3-MoE's ``gate_proj``/``up_proj``/
``down_proj`` under ``mlp``); the loader stacks them into the experts' two
parameters (:data:`EXPERT_PARTS`).
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrunner import envs
from jaxrunner.models.layers import ACTIVATIONS
from jaxrunner.ops.grouped_matmul import grouped_matmul

IMPLS = ("reference", "mgpu", "gathered")
"""How the experts multiply: sorted and grouped by ``ragged_dot`` (``reference``) or the Mosaic GPU kernel
(``mgpu``, Hopper, one device), or each (token, expert) pair by its gathered matrices (``gathered``)."""

AUTO = "auto"
"""The unforced choice: :func:`pick_impl` per program."""

GATHERED_PAIRS_PER_EXPERT = 0.25
"""``auto`` gathers while a program's (token, expert) pairs are at most this share of the experts: a gathered
pair reads its own matrices, a grouped product every touched expert's once plus the sort; at one Qwen3-30B-A3B
decode token (8 pairs of 128 experts) gathering measured 3.7x faster than ``ragged_dot``, at 64 tokens
(512 pairs) 3.6x slower (``benchmarks/moe_matmul.py``)."""

MODEL_TYPES = ("mixtral", "qwen3_moe")
"""HF ``model_type`` of the mixture-of-experts configs read here."""

EXPERT_PARTS = {"gate_up_proj": (("gate_proj", 1), ("up_proj", 1)), "down_proj": (("down_proj", None),)}
"""Each experts parameter and the per-expert checkpoint tensors it stacks: ``(name, slots)``, slots None for
a whole tensor (``down_proj``), else how many of the parameter's slot axis the tensor fills."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The experts of a mixture-of-experts decoder; layers not in ``sparse_layers`` keep a dense MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts {self.num_experts}]")


def moe_config(hf_config: Any) -> MoEConfig:
    """The experts of a Mixtral or Qwen3-MoE config."""
    num_layers = hf_config.num_hidden_layers
    num_experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    if hf_config.model_type == "mixtral":
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,
            sparse_layers=tuple(range(num_layers)),
        )
    else:  # qwen3_moe: every decoder_sparse_step-th layer, less mlp_only_layers
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        step = hf_config.decoder_sparse_step
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            renormalize=bool(hf_config.norm_topk_prob),
            sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        )
    return moe


_MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)


def mixtral_tensor_name(name: str) -> str:
    """A Mixtral checkpoint name in Qwen3-MoE's (and this package's) naming: ``block_sparse_moe`` is ``mlp``,
    an expert's ``w1``, ``w3``, ``w2`` are its ``gate_proj``, ``up_proj``, ``down_proj``."""
    for pattern, replacement in _MIXTRAL_NAMES:
        name = pattern.sub(replacement, name)
    return name


class Experts(nnx.Module):
    """``num_experts`` gated MLPs, stacked: ``gate_up_proj`` ``[experts, hidden, 2, features]`` (gate then up),
    ``down_proj`` ``[experts, features, hidden]``."""

    def __init__(self, hidden_size: int, config: MoEConfig, *, param_dtype, rngs: nnx.Rngs):
        e, h, f = config.num_experts, hidden_size, config.intermediate_size
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=(2, 3))
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, h, 2, f), param_dtype))
        self.down_proj = nnx.Param(
            nnx.initializers.lecun_normal(in_axis=1, out_axis=2)(rngs.params(), (e, f, h), param_dtype)
        )


class SparseMoeBlock(nnx.Module):
    """A mixture-of-experts MLP: the router (HF's ``gate``, a Linear to one logit per expert) and the experts."""

    def __init__(self, hidden_size: int, config: MoEConfig, hidden_act: str, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.gate = nnx.Linear(
            hidden_size, config.num_experts, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.experts = Experts(hidden_size, config, param_dtype=param_dtype, rngs=rngs)
        self.top_k, self.renormalize = config.top_k, config.renormalize
        self.impl = moe_impl(envs.JAXRUNNER_MOE_IMPL)
        self.act: Callable[[jax.Array], jax.Array] = ACTIVATIONS[hidden_act]
        self.dtype = dtype

    def __call__(
        self, x: Float[Array, "num_tokens hidden_size"], lora: Any = None
    ) -> Float[Array, "num_tokens hidden_size"]:
        if lora is not None:
            raise NotImplementedError("LoRA on mixture-of-experts layers is not supported")
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return experts_forward(
            x.astype(self.dtype),
            weights,
            experts,
            self.experts.gate_up_proj[...].astype(self.dtype),
            self.experts.down_proj[...].astype(self.dtype),
            self.act,
            self.impl,
        )


def moe_impl(forced: str | None) -> str:
    """The experts' products a model runs: ``forced`` (``$JAXRUNNER_MOE_IMPL``) if given, else :data:`AUTO`."""
    if forced is None:
        return AUTO
    if forced not in IMPLS:
        raise ValueError(f"MoE impl {forced!r} (${envs.MOE_IMPL_ENV_VAR}) is not one of {', '.join(IMPLS)}")
    return forced


def pick_impl(impl: str, num_pairs: int, num_experts: int) -> str:
    """``impl`` unless it is :data:`AUTO`; then ``"gathered"`` for at most :data:`GATHERED_PAIRS_PER_EXPERT`
    (token, expert) pairs an expert, else ``"reference"``."""
    if impl != AUTO:
        return impl
    return "gathered" if num_pairs <= GATHERED_PAIRS_PER_EXPERT * num_experts else "reference"


def route(
    router_logits: Float[Array, "num_tokens num_experts"], top_k: int, renormalize: bool
) -> tuple[Float[Array, "num_tokens top_k"], Int[Array, "num_tokens top_k"]]:
    """Each token's ``top_k`` experts and their weights: the softmax over every expert (float32), its
    ``top_k`` largest, renormalised to sum to one if ``renormalize``."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def experts_forward(
    x: Float[Array, "num_tokens hidden_size"],
    weights: Float[Array, "num_tokens top_k"],
    experts: Int[Array, "num_tokens top_k"],
    gate_up: Float[Array, "num_experts hidden_size 2 features"],
    down: Float[Array, "num_experts features hidden_size"],
    act: Callable[[jax.Array], jax.Array],
    impl: str = "reference",
) -> Float[Array, "num_tokens hidden_size"]:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])``, each expert running only its own rows.

    ``impl`` (one of :data:`IMPLS`, or :data:`AUTO`: :func:`pick_impl` for these shapes): ``"gathered"``
    multiplies each (token, expert) pair's row by its expert's gathered matrices; the others sort the
    ``num_tokens * top_k`` pairs by expert (stable), count them per expert, run the two grouped matmuls
    (``ops/grouped_matmul.py``), then put them back in order.
    Either way the pairs are summed in float32.
    """
    num_tokens, top_k = experts.shape
    num_experts, hidden, _, features = gate_up.shape
    impl = pick_impl(impl, num_tokens * top_k, num_experts)
    if impl == "gathered":
        h = jnp.einsum("th,tkhsf->tksf", x, gate_up[experts], preferred_element_type=jnp.float32).astype(x.dtype)
        out = jnp.einsum(
            "tkf,tkfh->tkh", act(h[:, :, 0]) * h[:, :, 1], down[experts], preferred_element_type=jnp.float32
        )
    else:
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        rows = x[order // top_k]
        gate_and_up = grouped_matmul(rows, gate_up.reshape(num_experts, hidden, 2 * features), group_sizes, impl=impl)
        hidden_rows = act(gate_and_up[:, :features]) * gate_and_up[:, features:]
        out_sorted = grouped_matmul(hidden_rows, down, group_sizes, impl=impl)
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(num_tokens, top_k, hidden)
    return jnp.einsum("tkh,tk->th", out.astype(jnp.float32), weights).astype(x.dtype)
