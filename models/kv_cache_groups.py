"""KV-cache groups: which layers share a block table, and which cache tensor each layer reads and writes.

vLLM's hybrid layout. A model whose layers mix full and sliding-window attention
(Gemma 2 and 3) gets one group per ``group_size`` layers of a kind, ``group_size``
being the fewer layers of either kind: Gemma 3's 5 local to 1 global layers make 6
groups of the same size. Every group draws its blocks from one pool, so the layers
at the same place in their groups can share one cache tensor (a block belongs to one
group at a time): ``group_size`` tensors in all. A sliding group then holds only the
blocks its window reaches (``engine/kv_cache_manager.py``), which is where the
memory goes further. Any other model keeps one group of every layer, each layer with
its own tensor, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    """Each group's layers and sliding window (None: full attention)."""

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @classmethod
    def one_group(cls, num_layers: int) -> KVCacheGroups:
        """Every layer in one full-attention group, each with its own tensor."""
        return cls((tuple(range(num_layers)),), (None,))

    @classmethod
    def for_layers(cls, windows: Sequence[int | None], max_model_len: int) -> KVCacheGroups:
        """Groups of full and sliding layers where the layers' ``windows`` (None: full attention; one each,
        ``TransformerConfig.layer_sliding_window``) mix them with one window shorter than ``max_model_len``;
        else one group."""
        sliding = tuple(i for i, w in enumerate(windows) if w is not None and w < max_model_len)
        full = tuple(i for i in range(len(windows)) if i not in sliding)
        if not sliding or not full or len({windows[i] for i in sliding}) > 1:
            return cls.one_group(len(windows))
        size = min(len(full), len(sliding))
        chunks = lambda layers: [layers[i : i + size] for i in range(0, len(layers), size)]
        full_groups, sliding_groups = chunks(full), chunks(sliding)
        return cls(
            tuple(full_groups + sliding_groups),
            (None,) * len(full_groups) + (windows[sliding[0]],) * len(sliding_groups),
        )

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_tensors(self) -> int:
        """Cache tensors (each a K and a V array): the largest group's layers."""
        return max(len(layers) for layers in self.layers)

    def layer_group(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self.layers) if layer in layers)

    def layer_tensor(self, layer: int) -> int:
        """The tensor ``layer`` uses: its place in its group."""
        return self.layers[self.layer_group(layer)].index(layer)
