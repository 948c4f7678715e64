"""Built-in models that run with no checkpoint: random weights and the byte tokenizer.

They exercise the whole engine (tokenize, prefill, decode, detokenize) on any
machine without a download; their text is random bytes, not language.
"""

from transformers import PreTrainedTokenizerFast

from jaxrunner.models import CausalLM, TransformerConfig, init_random_model
from jaxrunner.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
}


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in model rather than a checkpoint path."""
    return name in BUILTIN_MODELS


def load_builtin(
    name: str, *, dtype="float32", seed: int = 0
) -> tuple[CausalLM, TransformerConfig, PreTrainedTokenizerFast]:
    """The built-in model ``name`` with random weights from ``seed``, its config and tokenizer."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"Unknown built-in model {name!r}; the built-in models are {', '.join(BUILTIN_MODELS)}")
    config = BUILTIN_MODELS[name]
    return init_random_model(config, dtype=dtype, seed=seed), config, build_byte_tokenizer()
