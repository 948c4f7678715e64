"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints with a tokenizer and an image processor, saved by the tests:
the oracles of the vision-language engine tests (transformers on torch, float32).

The tokenizer is the byte tokenizer (``jaxrunner.models.tokenizer``) with Qwen's special tokens appended
and a Qwen-style chat template whose image parts render as ``<|vision_start|><|image_pad|><|vision_end|>``.
The image processor cuts 4-pixel patches and keeps images between 8x8 and 40x40 pixels.
"""

from os import PathLike
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

from jaxrunner.models.tokenizer import build_byte_tokenizer

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = range(259, 265)
VOCAB_SIZE = 272
MERGE = 2
PATCH = 4
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_vl_checkpoint(family: str, path: str | PathLike, seed: int = 0) -> Any:
    """A random model of ``family`` ("qwen2_vl" or "qwen2_5_vl") with its tokenizer and image processor
    in ``path``; returns the transformers model (eval mode, float32)."""
    text: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=IM_END,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    shape: dict[str, Any] = dict(num_heads=2, patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE)
    tokens: dict[str, Any] = dict(
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START, eos_token_id=IM_END
    )
    if family == "qwen2_5_vl":
        vision: dict[str, Any] = dict(
            depth=2, hidden_size=16, out_hidden_size=64, intermediate_size=24, window_size=16,
            fullatt_block_indexes=[1], **shape,
        )  # fmt: skip
        config: Any = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=2, embed_dim=16, hidden_size=64, mlp_ratio=2, **shape)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model: Any = model_class(config).eval()
    with torch.no_grad():
        for param in model.model.visual.parameters():  # HF starts biases and norms at constants
            param.normal_(0.0, 0.2)
        for param in model.model.language_model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD
    tokenizer.save_pretrained(path)
    image_processor().save_pretrained(path)
    return model


def image_processor() -> Any:
    """The tiny checkpoints' image processor: 4-pixel patches, images of 8x8 to 40x40 pixels."""
    return transformers.Qwen2VLImageProcessor(
        patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE, size={"shortest_edge": 64, "longest_edge": 1600}
    )


def random_image(height: int, width: int, seed: int) -> Image.Image:
    """An RGB image of random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_inputs(token_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """transformers' inputs for a prompt of ``token_ids`` with one ``IMAGE_PAD`` per image: the placeholders
    expanded as its processor does, the patches, the grids and the token types."""
    ids: list[int] = []
    kwargs: dict[str, torch.Tensor] = {}
    if images:
        processed = image_processor()(images=images, return_tensors="np")
        grids = iter(processed["image_grid_thw"].tolist())
        kwargs = dict(
            pixel_values=torch.tensor(processed["pixel_values"]),
            image_grid_thw=torch.tensor(processed["image_grid_thw"]),
        )
        for token in token_ids:
            ids += [token] * (int(np.prod(next(grids))) // MERGE**2 if token == IMAGE_PAD else 1)
    else:
        ids = list(token_ids)
    types = [1 if t == IMAGE_PAD else 0 for t in ids]
    return dict(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types], dtype=torch.int32), **kwargs)


def hf_greedy(model: Any, token_ids: list[int], images: list[Image.Image], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of the prompt (no EOS stop), as token ids."""
    inputs = hf_inputs(token_ids, images)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, inputs["input_ids"].shape[1] :].tolist()
