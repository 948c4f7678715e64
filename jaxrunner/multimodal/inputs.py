"""A request's multimodal items, with vLLM's names (``vllm.multimodal.inputs``).

Each image of a prompt becomes a ``MultiModalFeatureSpec``: its preprocessed
patches (what the vision encoder reads), the content hash that identifies it
(the encoder cache's key and part of the prefix cache's block hashes), and the
``PlaceholderRange`` of prompt tokens its embeddings replace.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jaxtyping import Float


@dataclasses.dataclass(frozen=True)
class PlaceholderRange:
    """The prompt tokens an item's embeddings take: ``length`` tokens from ``offset``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        """One past the item's last token."""
        return self.offset + self.length


@dataclasses.dataclass(frozen=True)
class ImagePatches:
    """One image as the vision encoder reads it: its patches and its grid of patches (frames, rows, columns)."""

    pixel_values: Float[np.ndarray, "num_patches patch_features"]
    grid_thw: tuple[int, int, int]

    @property
    def num_patches(self) -> int:
        return int(np.prod(self.grid_thw))


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalFeatureSpec:
    """One multimodal item of a request: its data, modality, content hash (``identifier``) and placeholders."""

    data: ImagePatches
    modality: str
    identifier: str
    mm_position: PlaceholderRange

    @property
    def num_embeds(self) -> int:
        """Embeddings the encoder makes for the item: one per placeholder token."""
        return self.mm_position.length
