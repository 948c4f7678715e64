"""Images in a prompt: read, preprocessed by the checkpoint's image processor, hashed, and given placeholders.

vLLM's multimodal processor does this job there. A prompt names each image once
with the model's image placeholder token (Qwen2-VL's ``<|image_pad|>``, between
``<|vision_start|>`` and ``<|vision_end|>``); the processor expands each to as
many tokens as the image has merged patches (grid t x h x w / merge_size²), as
transformers' ``Qwen2VLProcessor`` does, and records where they are. The
preprocessing is transformers' own (its PIL backend, no torch); the hash is of
the image's pixels, mode and size, so the same picture is encoded once and
shares its KV blocks whoever sends it.
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from PIL import Image

from jaxrunner.config import MultiModalConfig
from jaxrunner.models.transformer import TransformerConfig
from jaxrunner.multimodal.inputs import ImagePatches, MultiModalFeatureSpec, PlaceholderRange

MODALITIES = ("image",)
"""The modalities a prompt's ``multi_modal_data`` may carry."""


def load_image(item: object, where: str) -> Image.Image:
    """``item`` as a PIL image: a PIL image, an HxWxC (or HxW) uint8 array, a local file path, a ``file://``
    URL or a ``data:image/...;base64,`` URL. ValueError naming ``where`` if it is none of these or does not read."""
    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim not in (2, 3):
            raise ValueError(
                f"{where} is an array of {item.dtype} with shape {item.shape}; an image array must be uint8, "
                "height x width (x channels)."
            )
        image = Image.fromarray(item)
    elif isinstance(item, (str, PathLike)):
        image = _open(item, where)
    else:
        raise ValueError(
            f"{where} is a {type(item).__name__}; an image must be a PIL image, a uint8 array, a local path, "
            "a file:// URL or a data: URL."
        )
    try:
        image.load()
    except (OSError, ValueError) as error:
        raise ValueError(f"{where} cannot be read as an image: {error}") from error
    if min(image.size) < 1:
        raise ValueError(f"{where} is an empty image ({image.size[0]}x{image.size[1]} pixels).")
    return image


def _open(source: str | PathLike, where: str) -> Image.Image:
    text = str(source)
    try:
        if text.startswith("data:"):
            header, _, payload = text.partition(",")
            if not header.endswith(";base64"):
                raise ValueError("a data URL must be base64 (data:image/png;base64,...)")
            return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        if text.startswith(("http://", "https://")):
            raise ValueError("this engine reads no network: download the image and give its path or a PIL image")
        return Image.open(Path(text.removeprefix("file://")))
    except (OSError, ValueError) as error:
        raise ValueError(f"{where} cannot be read as an image: {error}") from error


def image_hash(image: Image.Image) -> str:
    """The image's content hash: of its mode, size and pixels."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class MultiModalProcessor:
    """Turns a prompt's token ids and ``multi_modal_data`` into the expanded token ids and the items' features."""

    def __init__(self, image_processor: Any, config: TransformerConfig, mm_config: MultiModalConfig):
        vision = config.vision
        assert vision is not None and config.image_token_id is not None, "a vision-language model's config"
        for name, expected in (
            ("patch_size", vision.patch_size),
            ("temporal_patch_size", vision.temporal_patch_size),
            ("merge_size", vision.spatial_merge_size),
        ):
            found = getattr(image_processor, name, None)
            if found != expected:
                raise ValueError(
                    f"The checkpoint's image processor has {name}={found}, but its vision tower takes {expected}: "
                    "the preprocessor_config.json does not belong to this model."
                )
        self.image_processor = image_processor
        self.image_token_id = config.image_token_id
        self.merge_area = vision.spatial_merge_size**2
        self.mm_config = mm_config
        pixels_per_token = (vision.patch_size * vision.spatial_merge_size) ** 2
        size = getattr(image_processor, "size", None) or {}
        max_pixels = size.get("longest_edge") or getattr(image_processor, "max_pixels", None)
        if max_pixels is None:
            raise ValueError("The checkpoint's image processor names no largest image (size['longest_edge']).")
        self.max_tokens_per_image = int(max_pixels) // pixels_per_token

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | PathLike, config: TransformerConfig, mm_config: MultiModalConfig
    ) -> MultiModalProcessor:
        """The processor of a checkpoint directory's ``preprocessor_config.json`` (transformers' PIL backend),
        with ``mm_config.mm_processor_kwargs`` applied."""
        try:
            image_processor = transformers.AutoImageProcessor.from_pretrained(
                model_dir, backend="pil", local_files_only=True, **mm_config.mm_processor_kwargs
            )
        except (OSError, ValueError) as error:
            raise FileNotFoundError(
                f"{model_dir}: a vision-language model needs its image processor's preprocessor_config.json, "
                f"which transformers could not load ({error})."
            ) from error
        return cls(image_processor, config, mm_config)

    def process(
        self, token_ids: list[int], multi_modal_data: Mapping[str, object]
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """The prompt's token ids with each image placeholder expanded, and one feature per image, in
        prompt order; ValueError saying what is wrong with the data."""
        for modality in multi_modal_data:
            if modality not in MODALITIES:
                raise ValueError(
                    f"multi_modal_data[{modality!r}] is not supported: this engine takes {', '.join(MODALITIES)}."
                )
        items = multi_modal_data.get("image")
        if items is None:
            return token_ids, []
        images = list(items) if isinstance(items, Sequence) and not isinstance(items, str) else [items]
        limit = self.mm_config.limit("image")
        if len(images) > limit:
            raise ValueError(
                f"The prompt has {len(images)} images, more than limit_mm_per_prompt allows ({limit}); "
                "raise LLM(..., limit_mm_per_prompt={'image': n}) or send fewer."
            )
        images = [load_image(item, f"multi_modal_data['image'][{i}]") for i, item in enumerate(images)]
        placeholders = [i for i, token in enumerate(token_ids) if token == self.image_token_id]
        if len(placeholders) != len(images):
            raise ValueError(
                f"The prompt has {len(placeholders)} image placeholders (token {self.image_token_id}) for "
                f"{len(images)} images: put one '<|vision_start|><|image_pad|><|vision_end|>' in the prompt "
                "per image, in order."
            )
        patches = self._preprocess(images)
        expanded: list[int] = []
        features = []
        start = 0
        for position, image, image_patches in zip(placeholders, images, patches):
            expanded += token_ids[start:position]
            length = image_patches.num_patches // self.merge_area
            features.append(
                MultiModalFeatureSpec(
                    image_patches, "image", image_hash(image), PlaceholderRange(len(expanded), length)
                )
            )
            expanded += [self.image_token_id] * length
            start = position + 1
        return expanded + token_ids[start:], features

    def _preprocess(self, images: list[Image.Image]) -> list[ImagePatches]:
        try:
            out = self.image_processor(images=images, return_tensors="np")
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"The image processor cannot read the prompt's images: {error}") from error
        grids = [(int(t), int(h), int(w)) for t, h, w in np.asarray(out["image_grid_thw"])]
        pixel_values = np.asarray(out["pixel_values"], np.float32)
        ends = np.cumsum([t * h * w for t, h, w in grids])
        return [ImagePatches(values, grid) for values, grid in zip(np.split(pixel_values, ends[:-1]), grids)]
