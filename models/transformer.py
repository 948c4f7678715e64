"""The Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3) in Flax NNX.

One configurable module covers the family: the members differ only in RoPE
scaling, q/k/v biases, per-head q/k RMSNorm and sliding-window attention.
Module and parameter names follow HuggingFace's (``model.layers[i].self_attn.
o_proj``...), with Flax leaves: a Linear's ``kernel`` is HF's ``weight``
transposed to ``[in, out]``, an Embed's ``embedding`` is HF's ``weight``;
HF's q/k/v and gate/up Linears are merged, each set into one matmul
(``qkv_proj``, ``gate_up_proj``: :class:`MergedProjection`). A Linear with FP8
weights (``models/quantization.py``) keeps HF's ``weight`` (``[*out, in]``, e4m3)
with its ``weight_scale`` (and ``input_scale`` where static) instead of a ``kernel``.

Tokens of all requests are packed along one axis; the paged KV cache and the
``AttentionMetadata`` say where each token's keys and values live.

Built with a ``mesh`` (tensor parallelism, ``jaxrunner/sharding.py``), a model
pads its vocabulary to a multiple of the ``model`` axis, runs each layer's KV
write and attention per KV-head shard, and gathers the logits whole; XLA
partitions the rest from the parameters' shardings.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.models import gemma, moe
from jaxrunner.models.kv_cache_groups import KVCacheGroups
from jaxrunner.models.layers import ACTIVATIONS, RMSNorm, apply_rope
from jaxrunner.models.lora import LoRABatch, LoRALayer
from jaxrunner.models.moe import MoEConfig, SparseMoeBlock
from jaxrunner.models.mrope import mrope_angles
from jaxrunner.models.quantization import Fp8Config, fp8_config_from_hf
from jaxrunner.models.qwen2_vl_vision import VisionConfig
from jaxrunner.models.rope import Rope, rope_from_params, rope_params
from jaxrunner.models.sharded_attention import write_and_attend
from jaxrunner.ops import AttentionBackend, AttentionMetadata
from jaxrunner.ops.fp8_matmul import fp8_matmul, fp8_matmul_impl, quantize_weight
from jaxrunner.ops.kv_write import is_fp8
from jaxrunner.sharding import RULES, padded_vocab_size, replicated, tensor_parallel_size

KVCache = tuple[
    Float[Array, "num_blocks block_size num_kv_heads head_dim"],
    Float[Array, "num_blocks block_size num_kv_heads head_dim"],
]
"""One layer's ``(k_cache, v_cache)``."""

_LAYER_TYPES = ("full_attention", "sliding_attention")

VISION_LANGUAGE_TYPES = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}
"""HF ``model_type`` of each vision-language model read here, and that of its language model."""

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
"""Computed scales are ``max|k| / K_SCALE_CONSTANT`` and ``max|v| / V_SCALE_CONSTANT`` (vLLM's defaults
of its ``K_SCALE_CONSTANT``/``V_SCALE_CONSTANT``): the largest value lands at 200 (100), below e4m3's 448."""

PENDING_KV_SCALE = 0.0
"""A KV scale still to be computed (``calculate_kv_scales``): no real scale is 0."""


class KVScale(nnx.Variable):
    """One attention layer's K (or V) cache scale, a float32 scalar: a stored value times it is the real one.

    The checkpoint's (``self_attn.k_scale``...), else 1.0; read only by FP8 caches.
    """


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The shape and variant flags of a decoder of any family read here.

    ``layer_types`` (HF's per-layer ``"full_attention"``/``"sliding_attention"``)
    is None when every layer uses ``sliding_window`` (itself None for full
    attention), as in Llama and Mistral. The Gemma flags (``models/gemma.py``) and
    ``moe`` (``models/moe.py``) default to the Llama family's behaviour.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: Rope = Rope()
    local_rope: Rope | None = None
    """The RoPE of sliding-window layers where it differs from ``rope`` (Gemma 3's local base)."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    """Norms scale by ``offset + weight`` (Gemma's ``1 + weight``)."""
    sandwich_norms: bool = False
    """Norms on the attention's and the MLP's outputs too, and one before the MLP (Gemma 2 and 3)."""
    embed_scale: float | None = None
    """Token embeddings multiplied by this, rounded to the compute dtype (Gemma: ``sqrt(hidden_size)``)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scaled by its inverse square root (None: ``head_dim``'s)."""
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    """Attention scores, and the final logits, mapped to ``cap * tanh(x / cap)`` (Gemma 2)."""
    moe: MoEConfig | None = None
    """The mixture-of-experts layers' shape (Mixtral, Qwen3-MoE); None: every layer's MLP is dense."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2-VL): the head's frequencies cut into (temporal, height, width) runs, each turned by
    its own position row; positions are then ``[3, num_tokens]``. None: plain RoPE of one row."""
    vision: VisionConfig | None = None
    """The vision tower of a vision-language model (``models/qwen2_vl_vision.py``); None: text only."""
    image_token_id: int | None = None
    video_token_id: int | None = None
    """The placeholder tokens whose embeddings the vision tower's outputs replace."""
    quantization: Fp8Config | None = None
    """FP8 weights in the decoder's Linears (``models/quantization.py``); None: every weight in ``param_dtype``."""

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (one of {sorted(ACTIVATIONS)})")
        if self.quantization is not None and (self.moe is not None or self.vision is not None):
            kind = "mixture-of-experts" if self.moe is not None else "vision-language"
            raise ValueError(f"FP8 weights in a {kind} model are not supported yet: load a bf16 checkpoint")
        for layer in range(self.num_layers if self.quantization is not None else 0):  # refuses half-FP8 merges
            self.fp8(layer, "self_attn", ("q_proj", "k_proj", "v_proj"))
            self.fp8(layer, "mlp", ("gate_proj", "up_proj"))
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(_LAYER_TYPES)
        ):
            raise ValueError(f"layer_types must be {self.num_layers} entries of {_LAYER_TYPES}, got {self.layer_types}")

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each of HF's Linear projections in a layer, by name."""
        hidden, q_width = self.hidden_size, self.num_heads * self.head_dim
        kv_width, features = self.num_kv_heads * self.head_dim, self.intermediate_size
        return {
            "q_proj": (hidden, q_width),
            "k_proj": (hidden, kv_width),
            "v_proj": (hidden, kv_width),
            "o_proj": (q_width, hidden),
            "gate_proj": (hidden, features),
            "up_proj": (hidden, features),
            "down_proj": (features, hidden),
        }

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to the whole sequence."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> Rope:
        """The RoPE of ``layer``: ``local_rope`` on a sliding-window layer where set, else ``rope``."""
        if self.local_rope is not None and self.layer_sliding_window(layer) is not None:
            return self.local_rope
        return self.rope

    def fp8(self, layer: int, block: str, linears: Sequence[str]) -> Fp8Config | None:
        """The FP8 config of ``layer``'s Linears ``linears`` (HF names) under ``block`` (``"self_attn"``,
        ``"mlp"``) where they hold FP8 weights, else None."""
        if self.quantization is None:
            return None
        modules = [f"model.layers.{layer}.{block}.{linear}" for linear in linears]
        return self.quantization if self.quantization.quantizes_all(modules) else None

    @property
    def sm_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf_config: Any, max_model_len: int | None = None) -> "TransformerConfig":
        """Reads a transformers config of a Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 or 3 (text),
        Mixtral or Qwen3-MoE model, or of a Qwen2-VL or Qwen2.5-VL model (its language model, M-RoPE and
        vision tower). ``max_model_len`` (None: ``max_position_embeddings``) is the length served, which
        picks LongRoPE's factors."""
        if getattr(hf_config, "model_type", None) in VISION_LANGUAGE_TYPES:
            text = cls.from_hf(hf_config.text_config, max_model_len)
            return dataclasses.replace(
                text,
                tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings)),
                vision=VisionConfig.from_hf(hf_config.vision_config),
                image_token_id=hf_config.image_token_id,
                video_token_id=hf_config.video_token_id,
                quantization=fp8_config_from_hf(getattr(hf_config, "quantization_config", None)),
            )
        model_type = getattr(hf_config, "model_type", None)
        rope, local_rope = _ropes_from_hf(hf_config, max_model_len)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if model_type in ("qwen2", *VISION_LANGUAGE_TYPES.values()):  # q/k/v biases and no o_proj bias
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        sliding_window = getattr(hf_config, "sliding_window", None)
        layer_types = None
        if hasattr(hf_config, "use_sliding_window"):  # Qwen2/3: a window only where enabled.
            if not hf_config.use_sliding_window:
                sliding_window = None
            elif sliding_window is not None:
                layer_types = _qwen_layer_types(hf_config)
        config = cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope=rope,
            local_rope=local_rope,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=getattr(hf_config, "hidden_act", None) or getattr(hf_config, "hidden_activation", "silu"),
            mrope_section=_mrope_section(hf_config),
        )
        if model_type in gemma.MODEL_TYPES:
            config = dataclasses.replace(config, **gemma.gemma_fields(hf_config))
        if model_type in moe.MODEL_TYPES:
            config = dataclasses.replace(config, moe=moe.moe_config(hf_config))
        quantization = fp8_config_from_hf(getattr(hf_config, "quantization_config", None))
        return config if quantization is None else dataclasses.replace(config, quantization=quantization)


def _ropes_from_hf(hf_config: Any, max_model_len: int | None) -> tuple[Rope, Rope | None]:
    """The RoPE of full-attention layers, and that of sliding-window layers where the config gives one
    per layer type (transformers 5's ``rope_parameters`` keyed by ``full_attention``/``sliding_attention``)."""
    params = rope_params(hf_config)
    if "full_attention" in params:
        local = params.get("sliding_attention")
        return (
            rope_from_params(params["full_attention"], hf_config, max_model_len),
            None if local is None else rope_from_params(local, hf_config, max_model_len),
        )
    return rope_from_params(params, hf_config, max_model_len), None


def _mrope_section(hf_config: Any) -> tuple[int, ...] | None:
    section = rope_params(hf_config).get("mrope_section")
    return None if section is None else tuple(int(n) for n in section)


def _qwen_layer_types(hf_config: Any) -> tuple[str, ...]:
    """Qwen's per-layer attention types; layers from ``max_window_layers`` on slide when HF lists none."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return tuple(layer_types)
    return tuple(
        "sliding_attention" if i >= hf_config.max_window_layers else "full_attention"
        for i in range(hf_config.num_hidden_layers)
    )


def config_norm(config: TransformerConfig, dim: int, *, dtype, param_dtype) -> Callable[[], RMSNorm]:
    """A maker of ``config``'s RMSNorms over ``dim`` features: its epsilon and weight offset."""
    return functools.partial(
        RMSNorm, dim, config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, offset=config.norm_weight_offset
    )


class Fp8Weights(nnx.Module):
    """A Linear's weights in FP8, as HF names them (``models/quantization.py``): ``weight`` ``[*out, in]`` in
    e4m3 (the contraction axis minor, as FP8 GEMMs read it), ``weight_scale`` ``[*out]`` (float32, a
    per-tensor scale repeated over its outputs) and, where inputs are scaled statically, ``input_scale``."""

    def init_fp8(self, in_features: int, out_shape: tuple[int, ...], fp8: Fp8Config | None, rngs: nnx.Rngs) -> None:
        """Random FP8 weights where ``fp8`` (else none): the kernel the unquantized Linear draws from the same
        ``rngs``, quantized per output, so that a random model in FP8 is its unquantized twin's quantization."""
        self.quantization = fp8
        values = scale = None
        if fp8 is not None:
            shape = (in_features, *out_shape)
            init = nnx.initializers.lecun_normal(in_axis=0, out_axis=tuple(range(1, len(shape))))
            values, scale = quantize_weight(jnp.moveaxis(init(rngs.params(), shape, jnp.float32), 0, -1))
        self.weight = None if values is None else nnx.Param(values)
        self.weight_scale = None if scale is None else nnx.Param(scale)
        static = fp8 is not None and fp8.static_input_scales
        self.input_scale = nnx.Param(jnp.ones((), jnp.float32)) if static else None

    def fp8_matmul(self, x: Float[Array, "num_tokens in_features"], dtype) -> Float[Array, " num_tokens *out_shape"]:
        """``x`` times the FP8 weights, by the implementation chosen for this many tokens."""
        assert self.quantization is not None and self.weight is not None and self.weight_scale is not None
        fp8 = self.quantization
        return fp8_matmul(
            x,
            self.weight[...],
            self.weight_scale[...],
            None if self.input_scale is None else self.input_scale[...],
            impl=fp8_matmul_impl(x.shape[0], fp8.activations, fp8.matmul),
            dtype=dtype,
        )


class MergedProjection(Fp8Weights):
    """Several of HF's Linears that read the same input, as one matmul (vLLM's merged and QKV linears).

    The kernel is ``[in, *groups, slots, width]``; ``parts`` names the HF Linears in
    order with the number of slots each fills in every group, which is how the
    loader assembles the kernel from them (``models/loader.py``). q/k/v become
    ``[in, kv_heads, group + 2, head_dim]`` (each KV head next to its query heads,
    so a split over KV heads gives every device whole groups), gate/up ``[in, 2,
    intermediate]``. One matmul instead of two or three: fewer, larger kernels.
    With LoRA the kernel is flattened to ``[in, outputs + LoRA columns]`` (``add_lora_columns``).
    With ``fp8``, an FP8 ``weight`` ``[*groups, slots, width, in]`` and its scales instead (:class:`Fp8Weights`).
    """

    def __init__(
        self,
        in_features: int,
        groups: tuple[int, ...],
        parts: tuple[tuple[str, int], ...],
        width: int,
        *,
        use_bias: bool,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        fp8: Fp8Config | None = None,
    ):
        shape = (in_features, *groups, sum(slots for _, slots in parts), width)
        if fp8 is None:
            init = nnx.initializers.lecun_normal(in_axis=0, out_axis=tuple(range(1, len(shape))))
            self.kernel = nnx.Param(init(rngs.params(), shape, param_dtype))
        else:
            self.kernel = None
        self.init_fp8(in_features, shape[1:], fp8, rngs)
        self.bias = nnx.Param(jnp.zeros(shape[1:], param_dtype)) if use_bias else None
        self.parts = parts
        self.dtype = dtype
        self.out_shape = shape[1:]
        self.num_outputs = int(np.prod(self.out_shape))
        self.lora_group: str | None = None  # the merged projection whose LoRA slots' A the kernel carries

    @property
    def split_points(self) -> np.ndarray:
        """Where each part after the first starts on the slot axis (the kernel's second-to-last)."""
        return np.cumsum([slots for _, slots in self.parts])[:-1]

    def __call__(
        self, x: Float[Array, "num_tokens in_features"], lora: LoRALayer | None = None
    ) -> list[Float[Array, "num_tokens *groups _ width"]]:
        """Each part's output, ``[num_tokens, *groups, slots, width]``, with ``lora``'s product added where
        the kernel carries the LoRA slots' A (``add_lora_columns``)."""
        bias = None if self.bias is None else self.bias[...]
        if self.kernel is None:
            y = self.fp8_matmul(x, self.dtype)
        elif self.lora_group is None:
            y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=1)
        else:
            y, shrunk = _project(x, self.kernel[...].astype(self.dtype), self.num_outputs, self.dtype)
            y = y if bias is None else y + bias.astype(self.dtype).reshape(-1)
            parts = jnp.split(y.reshape(x.shape[0], *self.out_shape), self.split_points, axis=-2)
            return parts if lora is None else lora.add(self.lora_group, parts, shrunk)
        y = y if bias is None else y + bias.astype(self.dtype)
        return jnp.split(y, self.split_points, axis=-2)


class Fp8Linear(Fp8Weights):
    """A Linear over ``[num_tokens, in]`` whose weights are FP8 (:class:`Fp8Weights`)."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype, param_dtype, rngs, fp8):
        self.init_fp8(in_features, (out_features,), fp8, rngs)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.dtype = dtype

    def __call__(
        self, x: Float[Array, "num_tokens in_features"], lora: LoRALayer | None = None
    ) -> Float[Array, "num_tokens out_features"]:
        y = self.fp8_matmul(x, self.dtype)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def linear(
    in_features: int, out_features: int, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs, fp8: Fp8Config | None
) -> "Linear | Fp8Linear":
    """A decoder Linear: :class:`Fp8Linear` where ``fp8``, else :class:`Linear`."""
    if fp8 is None:
        return Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    return Fp8Linear(
        in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs, fp8=fp8
    )


class Linear(nnx.Linear):
    """Flax's Linear over ``[num_tokens, in]``, whose kernel may carry the LoRA slots' A after its outputs."""

    lora_group: str | None = None
    """The merged projection (``models/lora.py``) whose LoRA slots' A the kernel carries, if any."""

    def __call__(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, x: Float[Array, "num_tokens in_features"], lora: LoRALayer | None = None
    ) -> Float[Array, "num_tokens out_features"]:
        y, shrunk = _project(x, self.kernel[...], self.out_features, self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y if lora is None or self.lora_group is None else lora.add(self.lora_group, [y], shrunk)[0]


def _project(
    x: Float[Array, "num_tokens in_features"], kernel: Float[Array, "in_features ..."], num_outputs: int, dtype
) -> tuple[Float[Array, "num_tokens num_outputs"], Float[Array, "num_tokens lora_columns"]]:
    """``x`` times the kernel (its outputs flattened): the projection's outputs, then the columns after them
    (every LoRA slot's shrink where the kernel carries them; none otherwise)."""
    y = jnp.dot(x.astype(dtype), kernel.astype(dtype).reshape(kernel.shape[0], -1))
    return y[:, :num_outputs], y[:, num_outputs:]


class Attention(nnx.Module):
    """GQA self-attention over the paged KV cache, with RoPE and optional q/k norm."""

    def __init__(self, config: TransformerConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs, mesh: Mesh | None):
        group = config.num_heads // config.num_kv_heads
        self.qkv_proj = MergedProjection(
            config.hidden_size,
            (config.num_kv_heads,),
            (("q_proj", group), ("k_proj", 1), ("v_proj", 1)),
            config.head_dim,
            use_bias=config.attention_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            fp8=config.fp8(layer, "self_attn", ("q_proj", "k_proj", "v_proj")),
        )
        self.o_proj = linear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            use_bias=config.o_proj_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            fp8=config.fp8(layer, "self_attn", ("o_proj",)),
        )
        norm = config_norm(config, config.head_dim, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.sliding_window = config.layer_sliding_window(layer)
        self.sm_scale, self.soft_cap = config.sm_scale, config.attn_soft_cap
        self.mesh = mesh
        self.k_scale = KVScale(jnp.ones((), jnp.float32))
        self.v_scale = KVScale(jnp.ones((), jnp.float32))
        # vLLM's flag: pending scales (PENDING_KV_SCALE) are set from the first keys and values written.
        self.calculate_kv_scales = False

    def __call__(
        self,
        x: Float[Array, "num_tokens hidden_size"],
        cos: Float[Array, "num_tokens half_head_dim"],
        sin: Float[Array, "num_tokens half_head_dim"],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        attention_backend: AttentionBackend | None = None,
        lora: LoRALayer | None = None,
    ) -> tuple[Float[Array, "num_tokens hidden_size"], KVCache]:
        t = x.shape[0]
        # [num_tokens, num_kv_heads, slots, head_dim]; query head h reads KV head h // group
        q, k, v = self.qkv_proj(x, lora)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = write_and_attend(
            q,
            k,
            v,
            kv_cache,
            metadata,
            mesh=self.mesh,
            backend=attention_backend,
            sm_scale=self.sm_scale,
            kv_scales=self.kv_scales(k, v, metadata.slot_mapping >= 0) if is_fp8(kv_cache[0].dtype) else None,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
        )
        out = out.reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(out, lora), kv_cache

    def kv_scales(
        self,
        k: Float[Array, "num_tokens num_kv_heads head_dim"],
        v: Float[Array, "num_tokens num_kv_heads head_dim"],
        written: Bool[Array, " num_tokens"],
    ) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """The ``(k_scale, v_scale)`` this step writes and reads the FP8 cache with.

        With ``calculate_kv_scales``, a pending scale becomes, for good, ``max|k| /
        K_SCALE_CONSTANT`` (``max|v| / V_SCALE_CONSTANT``) over the rows written (on
        the device: a select, so no step compiles twice). One that stays pending (all
        written rows zero, or none) reads as 1: the zeros it stored are right under
        any later scale.
        """
        if not self.calculate_kv_scales:
            return self.k_scale[...], self.v_scale[...]
        scales = []
        for scale, x, constant in ((self.k_scale, k, K_SCALE_CONSTANT), (self.v_scale, v, V_SCALE_CONSTANT)):
            amax = jnp.max(jnp.where(written[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0))
            value = jnp.where(scale[...] == PENDING_KV_SCALE, amax / constant, scale[...])
            scale.set_value(value)
            scales.append(jnp.where(value == PENDING_KV_SCALE, 1.0, value))
        return scales[0], scales[1]


class MLP(nnx.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, SwiGLU with ``silu``, GeGLU with ``gelu_pytorch_tanh``."""

    def __init__(self, config: TransformerConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.gate_up_proj = MergedProjection(
            config.hidden_size,
            (),
            (("gate_proj", 1), ("up_proj", 1)),
            config.intermediate_size,
            use_bias=config.mlp_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            fp8=config.fp8(layer, "mlp", ("gate_proj", "up_proj")),
        )
        self.down_proj = linear(
            config.intermediate_size,
            config.hidden_size,
            use_bias=config.mlp_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            fp8=config.fp8(layer, "mlp", ("down_proj",)),
        )
        self.act = ACTIVATIONS[config.hidden_act]

    def __call__(
        self, x: Float[Array, "num_tokens hidden_size"], lora: LoRALayer | None = None
    ) -> Float[Array, "num_tokens hidden_size"]:
        gate, up = self.gate_up_proj(x, lora)
        return self.down_proj(self.act(gate[:, 0]) * up[:, 0], lora)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    With ``sandwich_norms`` (Gemma), ``x + norm(attn(norm(x)))``, then ``x +
    norm(mlp(norm(x)))``: HF's ``post_attention_layernorm`` is then the norm of the
    attention's output, and ``pre_feedforward_layernorm`` the MLP's input norm. A
    mixture-of-experts layer's ``mlp`` is a :class:`SparseMoeBlock`.
    """

    def __init__(self, config: TransformerConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs, mesh: Mesh | None):
        norm = config_norm(config, config.hidden_size, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mesh=mesh)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if config.sandwich_norms else None
        if config.moe is not None and layer in config.moe.sparse_layers:
            self.mlp = SparseMoeBlock(
                config.hidden_size, config.moe, config.hidden_act, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
        else:
            self.mlp = MLP(config, layer, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self,
        x: Float[Array, "num_tokens hidden_size"],
        cos: Float[Array, "num_tokens half_head_dim"],
        sin: Float[Array, "num_tokens half_head_dim"],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        attention_backend: AttentionBackend | None = None,
        lora: LoRALayer | None = None,
    ) -> tuple[Float[Array, "num_tokens hidden_size"], KVCache]:
        normed = self.input_layernorm(x)
        attn_out, kv_cache = self.self_attn(normed, cos, sin, kv_cache, metadata, attention_backend, lora)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attn_out
            return x + self.mlp(self.post_attention_layernorm(x), lora), kv_cache
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lora)), kv_cache


class Backbone(nnx.Module):
    """HF's ``model``: token embedding, decoder layers and the final norm."""

    def __init__(self, config: TransformerConfig, *, dtype, param_dtype, rngs: nnx.Rngs, mesh: Mesh | None):
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = decoder_layers(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mesh=mesh)
        self.norm = config_norm(config, config.hidden_size, dtype=dtype, param_dtype=param_dtype)()


def decoder_layers(config: TransformerConfig, *, dtype, param_dtype, rngs: nnx.Rngs, mesh: Mesh | None) -> nnx.List:
    """The ``num_layers`` decoder layers of ``config``."""
    return nnx.List(
        [
            DecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mesh=mesh)
            for i in range(config.num_layers)
        ]
    )


def run_layers(
    layers: Sequence[DecoderLayer],
    config: TransformerConfig,
    x: Float[Array, "num_tokens hidden_size"],
    positions: Int[Array, " num_tokens"] | Int[Array, "3 num_tokens"],
    kv_caches: list[KVCache],
    metadata: AttentionMetadata | tuple[AttentionMetadata, ...],
    attention_backend: AttentionBackend | None = None,
    lora: LoRABatch | None = None,
    kv_cache_groups: KVCacheGroups | None = None,
) -> tuple[Float[Array, "num_tokens hidden_size"], list[KVCache]]:
    """The decoder layers over ``x`` with RoPE at ``positions`` (M-RoPE's three rows with
    ``config.mrope_section``), and each token's LoRA adapter with ``lora``; and their updated caches.

    With ``kv_cache_groups``, ``kv_caches`` holds one cache per tensor and ``metadata`` one per group:
    each layer reads and writes its tensor (after the layers before it that share it) with its group's.
    Without, one cache per layer and one metadata for all.
    """
    cos_sin: dict[Rope, tuple[jax.Array, jax.Array]] = {}  # one per distinct RoPE, shared by its layers
    caches = list(kv_caches)
    if kv_cache_groups is None and len(caches) != len(layers):
        raise ValueError(f"{len(caches)} KV caches for {len(layers)} layers")
    for i, layer in enumerate(layers):
        rope = config.layer_rope(i)
        if rope not in cos_sin:
            cos_sin[rope] = rope_cos_sin(rope, config, positions)
        cos, sin = cos_sin[rope]
        if kv_cache_groups is None:
            t, layer_metadata = i, metadata
        else:
            t = kv_cache_groups.layer_tensor(i)
            layer_metadata = metadata[kv_cache_groups.layer_group(i)] if isinstance(metadata, tuple) else metadata
        if not isinstance(layer_metadata, AttentionMetadata):
            raise TypeError("one AttentionMetadata per KV-cache group goes with kv_cache_groups")
        layer_lora = None if lora is None else lora.layer(i)
        x, caches[t] = layer(x, cos, sin, caches[t], layer_metadata, attention_backend, layer_lora)
    return x, caches


def rope_cos_sin(
    rope: Rope, config: TransformerConfig, positions: Int[Array, " num_tokens"] | Int[Array, "3 num_tokens"]
) -> tuple[Float[Array, "num_tokens half_head_dim"], Float[Array, "num_tokens half_head_dim"]]:
    """``rope``'s cos and sin at ``positions`` (M-RoPE's three rows with ``config.mrope_section``), float32."""
    inv_freq = rope.inv_freq(config.head_dim)
    if config.mrope_section:
        angles = mrope_angles(positions, jnp.asarray(inv_freq), config.mrope_section)
    else:
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    factor = rope.attention_factor
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def check_tensor_parallel(config: TransformerConfig, tp: int) -> None:
    """Raise ValueError, saying what to change, when ``config`` cannot be split over ``tp`` devices."""
    kv_heads, features = config.num_kv_heads, config.intermediate_size
    valid = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and features % d == 0]
    if kv_heads % tp:
        replication = (
            "; replicating KV heads over devices (tensor_parallel_size > num_kv_heads) is not supported"
            if tp > kv_heads
            else ""
        )
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's num_kv_heads ({kv_heads}): every "
            f"device holds whole KV heads{replication}. Use a tensor_parallel_size in {valid}."
        )
    if features % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's intermediate_size ({features}): the "
            f"MLP's features are split evenly over the devices. Use a tensor_parallel_size in {valid}."
        )


class CausalLM(nnx.Module):
    """A Llama-family causal LM over packed tokens and a paged KV cache.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the
    weights (default: ``dtype``). Norm statistics and RoPE are float32; the
    logits come out of the lm_head in ``dtype`` and are returned as float32.
    ``mesh`` (None: one device) splits the model over its ``model`` axis; the
    parameters' shardings come from ``jaxrunner.sharding.param_shardings``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        check_tensor_parallel(config, tensor_parallel_size(mesh))
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.mesh = mesh
        self.model = Backbone(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, mesh=mesh)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Linear(
                config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
        )
        self._pad_vocab(padded_vocab_size(config.vocab_size, tensor_parallel_size(mesh)))

    def _pad_vocab(self, padded: int) -> None:
        """Zero embedding rows and lm_head columns up to ``padded`` (never looked up; sliced off the logits).

        Padding after the random draws keeps the real rows those of an unpadded model.
        """
        extra = padded - self.config.vocab_size
        if not extra:
            return
        embed = self.model.embed_tokens
        embed.embedding.set_value(jnp.pad(embed.embedding[...], ((0, extra), (0, 0))))
        embed.num_embeddings = padded
        if self.lm_head is not None:
            self.lm_head.kernel.set_value(jnp.pad(self.lm_head.kernel[...], ((0, 0), (0, extra))))
            self.lm_head.out_features = padded

    def __call__(
        self,
        input_ids: Int[Array, " num_tokens"],
        positions: Int[Array, " num_tokens"] | Int[Array, "3 num_tokens"],
        kv_caches: list[KVCache],
        metadata: AttentionMetadata | tuple[AttentionMetadata, ...],
        attention_backend: AttentionBackend | None = None,
        lora: LoRABatch | None = None,
        inputs_embeds: Float[Array, "num_tokens hidden_size"] | None = None,
        kv_cache_groups: KVCacheGroups | None = None,
    ) -> tuple[Float[Array, "num_tokens hidden_size"], list[KVCache]]:
        """Hidden states after the final norm, and every layer's updated KV cache.

        ``attention_backend`` picks the attention ops' implementation (None: that of
        JAX's default devices); a runner passes the one it resolved for its mesh.
        ``lora`` adds each token's LoRA adapter to every projection it targets.
        ``inputs_embeds`` (vLLM's) replaces the token embeddings of ``input_ids``, as a
        vision-language model gives them with its images' embeddings in place.
        ``kv_cache_groups`` (with ``metadata`` one per group) lays the caches out as
        :func:`run_layers` says.
        """
        x, new_caches = run_layers(
            self.model.layers,
            self.config,
            self.embed(input_ids) if inputs_embeds is None else inputs_embeds,
            positions,
            kv_caches,
            metadata,
            attention_backend,
            lora,
            kv_cache_groups,
        )
        return self.model.norm(x), new_caches

    def embed(self, input_ids: Int[Array, " num_tokens"]) -> Float[Array, "num_tokens hidden_size"]:
        """The token embeddings, times ``config.embed_scale`` (rounded to the compute dtype, as HF's Gemma)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is None:
            return x
        return x * jnp.asarray(self.config.embed_scale, x.dtype)

    def compute_logits(self, hidden: Float[Array, "num_rows hidden_size"]) -> Float[Array, "num_rows vocab_size"]:
        """Vocabulary logits (through the embedding when tied), whole on every device.

        As vLLM's lm_head, the matmul's output is in the model's dtype, then cast to
        float32 for the sampler. (A bf16 x bf16 -> float32 product of one row made XLA
        convert the whole 1 GB weight to a 2 GB float32 copy every step and read that:
        about 4 GB of traffic more.)
        """
        if self.lm_head is None:
            weight, spec = self.model.embed_tokens.embedding[...], "ne,ve->nv"
        else:
            weight, spec = self.lm_head.kernel[...], "ne,ev->nv"
        logits = jnp.einsum(
            spec, hidden.astype(self.dtype), weight.astype(self.dtype), preferred_element_type=self.dtype
        )
        if self.mesh is not None and tensor_parallel_size(self.mesh) > 1:
            # Each device computes its vocabulary slice, then the slices are gathered:
            # samplers read whole rows (and no device gathers the whole weight).
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, RULES.spec((None, "vocab"))))
            logits = jax.lax.with_sharding_constraint(logits, replicated(self.mesh))
        logits = logits[:, : self.config.vocab_size].astype(jnp.float32)
        cap = self.config.final_soft_cap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
