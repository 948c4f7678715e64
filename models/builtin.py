"""Built-in models that run with no checkpoint: random weights and the byte tokenizer.

They exercise the whole engine (tokenize, prefill, decode, detokenize) on any
machine without a download; their text is random bytes, not language.
"""

import difflib
import re
from pathlib import Path

from jax.sharding import Mesh
from transformers import PreTrainedTokenizerFast

from jaxrunner.models import CausalLM, TransformerConfig, init_random_model, load_model
from jaxrunner.models.loader import with_quantization
from jaxrunner.models.rope import Llama3RopeScaling, Rope
from jaxrunner.models.safetensors_io import CONFIG_FILE, read_json_object
from jaxrunner.models.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _llama3(*, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int) -> TransformerConfig:
    """A Llama-3.1 shape: 8 KV heads of 128, the 128k vocabulary, RoPE scaled to 128k positions."""
    return TransformerConfig(
        vocab_size=128256,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope=Rope(
            500000.0,
            Llama3RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
            ),
        ),
        max_position_embeddings=131072,
    )


BUILTIN_MODELS: dict[str, TransformerConfig] = {
    # Llama-shaped with GQA; the vocabulary is the byte tokenizer's 259 ids padded to 320,
    # as real checkpoints pad theirs: ids 259..319 are never produced by the tokenizer.
    "tiny-llama": TransformerConfig(
        vocab_size=_round_up(BYTE_VOCAB_SIZE, 64),
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
    ),
    # Llama-3.1-8B's and -70B's exact shapes with random weights: for benchmarks on GPUs
    # (70B in bf16 is 141 GB: tensor parallelism over 2+ H200s or 4 H100s).
    "random-llama3-8b": _llama3(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32),
    "random-llama3-70b": _llama3(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64),
}
# The dtype "auto" picks: float32 for the tiny model (exact tests), bf16 at real size.
DEFAULT_DTYPES = {"tiny-llama": "float32", "random-llama3-8b": "bfloat16", "random-llama3-70b": "bfloat16"}


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in model rather than a checkpoint path."""
    return name in BUILTIN_MODELS


def check_model_name(name: str) -> None:
    """Refuses (``ValueError``) a ``name`` that is neither a built-in model nor a checkpoint directory, with the
    built-in names, the nearest one to a misspelling, and how to fetch a Hugging Face Hub model first.
    A directory's config.json must parse (``CheckpointError`` naming it), before anything loads."""
    if is_builtin(name):
        return
    if Path(name).is_dir():
        read_json_object(Path(name) / CONFIG_FILE)
        return
    hints = []
    near = difflib.get_close_matches(name, BUILTIN_MODELS, n=1)
    if near:
        hints.append(f"Did you mean {near[0]!r}?")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not Path(name).exists():
        hints.append(
            f"{name!r} looks like a Hugging Face Hub id: download it first (e.g. "
            f"`hf download {name} --local-dir DIR`) and give DIR."
        )
    message = (
        f"model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a checkpoint directory; "
        "jaxrunner loads local checkpoint directories only and downloads nothing."
    )
    raise ValueError(" ".join([message, *hints]))


def load_builtin(
    name: str, *, dtype="float32", seed: int = 0, mesh: Mesh | None = None
) -> tuple[CausalLM, TransformerConfig, PreTrainedTokenizerFast]:
    """The built-in model ``name`` with random weights from ``seed`` (the same on any ``mesh``),
    its config and tokenizer."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"Unknown built-in model {name!r}; the built-in models are {', '.join(BUILTIN_MODELS)}")
    config = BUILTIN_MODELS[name]
    return init_random_model(config, dtype=dtype, seed=seed, mesh=mesh), config, build_byte_tokenizer()


def load_named_model(
    name: str,
    *,
    dtype="float32",
    seed: int = 0,
    mesh: Mesh | None = None,
    max_model_len: int | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """A built-in model (random weights from ``seed``) or a checkpoint directory's, on ``mesh``, for serving
    ``max_model_len`` tokens (None: the model's positions), with ``quantization`` (vLLM's: ``"fp8"``) applied;
    any other ``name`` is refused by :func:`check_model_name`."""
    check_model_name(name)
    if is_builtin(name):
        config = with_quantization(BUILTIN_MODELS[name], quantization)
        return init_random_model(config, dtype=dtype, seed=seed, mesh=mesh)
    return load_model(name, dtype=dtype, mesh=mesh, max_model_len=max_model_len, quantization=quantization)[0]
