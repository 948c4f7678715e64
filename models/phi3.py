"""Phi-3: a Llama-family decoder whose checkpoints fuse q/k/v and gate/up, with LongRoPE for long contexts.

The decoder (``models/transformer.py``) already merges those projections, so
Phi-3 differs only in how its checkpoint names them: one ``qkv_proj`` tensor (the
query rows, then the keys', then the values') and one ``gate_up_proj`` (gate rows,
then up). :func:`phi3_tensors` cuts them into the parts the loader assembles.
LongRoPE's factors are read with the rest of the RoPE (``models/rope.py``).
"""

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxrunner.models.transformer import TransformerConfig


def phi3_tensors(name: str, array: np.ndarray, config: "TransformerConfig") -> list[tuple[str, np.ndarray]]:
    """A Phi-3 checkpoint tensor as the tensors this package names: fused ``qkv_proj`` and ``gate_up_proj``
    weights (and biases) cut into their parts, any other tensor as it is.

    A fused tensor whose rows are not its parts' raises ``ValueError``.
    """
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    fused = {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", q_rows),
            ("self_attn.k_proj", kv_rows),
            ("self_attn.v_proj", kv_rows),
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", config.intermediate_size), ("mlp.up_proj", config.intermediate_size)),
    }
    prefix, _, leaf = name.rpartition(".")
    for fused_name, parts in fused.items():
        if not prefix.endswith(fused_name):
            continue
        expected = sum(rows for _, rows in parts)
        if array.shape[0] != expected:
            raise ValueError(
                f"tensor {name!r} has shape {array.shape}; the config gives {expected} rows "
                f"({' + '.join(str(rows) for _, rows in parts)})"
            )
        base = prefix[: -len(fused_name)]
        cuts = np.cumsum([rows for _, rows in parts])[:-1]
        return [(f"{base}{part}.{leaf}", piece) for (part, _), piece in zip(parts, np.split(array, cuts, axis=0))]
    return [(name, array)]
