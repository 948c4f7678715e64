"""Qwen2-VL and Qwen2.5-VL loaded from checkpoints transformers saved, against transformers: prompt logits of
prompts with one image, with two, and with text only, packed in one batch (float32)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from packed_batch import packed_metadata
from test_model_parity import BLOCK_SIZE, NUM_BLOCKS, pack, random_caches, rel_err

from jaxrunner.models import load_model
from jaxrunner.models.mrope import IMAGE, TEXT, prompt_positions
from jaxrunner.models.qwen2_vl import VisionLanguageLM
from jaxrunner.models.qwen2_vl_vision import frame_ids, patch_positions, window_ids

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START = 150, 151, 152
MERGE = 2
# Each prompt: (text, image grid in patches) pieces; a grid's image takes t*h*w / 4 placeholder tokens.
PROMPTS = [
    [5, (1, 4, 6), 4],
    [3, (1, 4, 4), 2, (1, 2, 8), 3],
    [7],
]
NUM_TOKENS = 48


def save_tiny_vl(family: str, path) -> Any:
    text: dict[str, Any] = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 4.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip  # a small theta: every frequency turns enough for each position row to show in the logits
    shape: dict[str, Any] = dict(num_heads=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=MERGE)
    tokens: dict[str, Any] = dict(
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START
    )
    if family == "qwen2_5_vl":
        vision: dict[str, Any] = dict(
            depth=2, hidden_size=16, out_hidden_size=64, intermediate_size=24, window_size=8,
            fullatt_block_indexes=[1], **shape,
        )  # fmt: skip
        config: Any = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision: dict[str, Any] = dict(depth=2, embed_dim=16, hidden_size=64, mlp_ratio=2, **shape)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    model: Any = model_class(config).eval()
    with torch.no_grad():
        for param in model.model.visual.parameters():  # HF starts biases and norms at constants
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model


def prompt_tokens(prompt: list, rng: np.random.Generator) -> tuple[list[int], list[int], list[tuple]]:
    """Token ids (text random, images as placeholders), token types, and the prompt's image grids."""
    ids, types, grids = [], [], []
    for piece in prompt:
        if isinstance(piece, int):
            ids += rng.integers(0, 140, piece).tolist()
            types += [TEXT] * piece
        else:
            n = piece[0] * piece[1] * piece[2] // MERGE**2
            ids += [IMAGE_TOKEN] * n
            types += [IMAGE] * n
            grids.append(piece)
    return ids, types, grids


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_prompt_logits_match_transformers(family, tmp_path):
    hf_model = save_tiny_vl(family, tmp_path)
    model, config = load_model(tmp_path)
    assert isinstance(model, VisionLanguageLM) and config.vision is not None
    rng = np.random.default_rng(1)
    prompts = [prompt_tokens(p, rng) for p in PROMPTS]
    grids = [g for _, _, gs in prompts for g in gs]
    patches = rng.normal(size=(sum(t * h * w for t, h, w in grids), config.vision.patch_features)).astype(np.float32)

    refs, first = [], 0
    for ids, types, prompt_grids in prompts:
        count = sum(t * h * w for t, h, w in prompt_grids)
        vision = {}
        if prompt_grids:
            vision = dict(
                pixel_values=torch.tensor(patches[first : first + count]),
                image_grid_thw=torch.tensor(prompt_grids),
                mm_token_type_ids=torch.tensor([types], dtype=torch.int32),
            )
        first += count
        with torch.no_grad():
            refs.append(hf_model(input_ids=torch.tensor([ids]), **vision).logits[0].numpy())

    lens = [len(ids) for ids, _, _ in prompts]
    positions = np.zeros((3, NUM_TOKENS), np.int64)
    starts = np.cumsum([0, *lens])
    for (_, types, prompt_grids), start in zip(prompts, starts):
        positions[:, start : start + len(types)] = prompt_positions(types, prompt_grids, [], MERGE)[0]
    metadata, _ = packed_metadata(lens, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_tokens=NUM_TOKENS)
    vision_inputs = (
        jnp.asarray(patches),
        jnp.asarray(patch_positions(grids, MERGE)),
        jnp.asarray(frame_ids(grids)),
        jnp.asarray(window_ids(grids, config.vision)),
    )
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, input_ids, positions, kv_caches, metadata, vision_inputs):
        m = nnx.merge(graphdef, state)
        embeds = m.embed_with_vision(input_ids, m.embed_vision(*vision_inputs))
        hidden, _ = m(input_ids, positions, kv_caches, metadata, inputs_embeds=embeds)
        return m.compute_logits(hidden)

    input_ids = pack([ids for ids, _, _ in prompts], NUM_TOKENS)
    caches = random_caches(config, jnp.float32, 2)
    logits = np.asarray(step(state, input_ids, jnp.asarray(positions), caches, metadata, vision_inputs))
    for i, ref in enumerate(refs):
        assert rel_err(logits[starts[i] : starts[i + 1]], ref) < 1e-4, (
            i,
            rel_err(logits[starts[i] : starts[i + 1]], ref),
        )
