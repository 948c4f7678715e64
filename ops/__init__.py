"""Device ops: paged KV-cache writes and ragged paged attention (reference + kernels), per KV-head shard under TP."""

from jaxrunner.ops.attention import ragged_paged_attention
from jaxrunner.ops.attention_metadata import AttentionMetadata
from jaxrunner.ops.kv_write import write_kv
from jaxrunner.ops.sharded_attention import write_and_attend

__all__ = ["AttentionMetadata", "ragged_paged_attention", "write_and_attend", "write_kv"]
