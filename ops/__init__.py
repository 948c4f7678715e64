"""Device ops: paged KV-cache writes and ragged paged attention, Mosaic GPU kernels beside pure-JAX references."""

from jaxrunner.ops.attention import ragged_paged_attention
from jaxrunner.ops.attention_backend import AttentionBackend
from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.kv_write import write_kv

__all__ = ["AttentionBackend", "AttentionMetadata", "ragged_paged_attention", "write_kv"]
