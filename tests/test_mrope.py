"""M-RoPE positions and angles against transformers' Qwen2-VL and Qwen2.5-VL (``get_rope_index``, the rotary
embedding), on prompts of text, images and videos."""

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl

from jaxrunner.models.mrope import IMAGE, TEXT, VIDEO, mrope_angles, prompt_positions

MERGE = 2
SECTIONS = [2, 3, 3]  # head_dim 16
TOKENS_PER_SECOND = 4  # Qwen2.5-VL's temporal positions a second of video


def tiny_config(family: str) -> Any:
    text = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTIONS},
    )
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE, out_hidden_size=32)
    if family == "qwen2_5_vl":
        vision.update(intermediate_size=32, tokens_per_second=TOKENS_PER_SECOND)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision)


def span(kind: int, grid) -> list[int]:
    return [kind] * (grid[0] * grid[1] * grid[2] // MERGE**2)


# (token types, image grids, video grids, seconds per video grid)
PROMPTS = {
    "one image": ([TEXT] * 3 + span(IMAGE, (1, 4, 6)) + [TEXT] * 5, [(1, 4, 6)], [], []),
    "two images": (
        [TEXT] * 2 + span(IMAGE, (1, 6, 4)) + [TEXT] * 3 + span(IMAGE, (1, 2, 2)) + [TEXT] * 4,
        [(1, 6, 4), (1, 2, 2)],
        [],
        [],
    ),
    "image then video": (
        [TEXT] + span(IMAGE, (1, 2, 4)) + [TEXT] * 2 + span(VIDEO, (3, 4, 4)) + [TEXT] * 3,
        [(1, 2, 4)],
        [(3, 4, 4)],
        [0.5],
    ),
    "starts with an image": (span(IMAGE, (1, 8, 2)) + [TEXT] * 6, [(1, 8, 2)], [], []),
}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_positions_match_transformers(family, prompt):
    types, images, videos, seconds = PROMPTS[prompt]
    config = tiny_config(family)
    module = modeling_qwen2_5_vl.Qwen2_5_VLModel if family == "qwen2_5_vl" else modeling_qwen2_vl.Qwen2VLModel
    model: Any = module(config)
    kwargs = {"second_per_grid_ts": torch.tensor(seconds)} if family == "qwen2_5_vl" and seconds else {}
    ids = torch.zeros(1, len(types), dtype=torch.long)
    ref, ref_delta = model.get_rope_index(
        ids,
        torch.tensor([types], dtype=torch.int32),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        **kwargs,
    )
    intervals = [TOKENS_PER_SECOND * s for s in seconds] if family == "qwen2_5_vl" else []
    ours, delta = prompt_positions(types, images, videos, MERGE, intervals)
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta[0, 0])


def test_mrope_angles_match_transformers_rotary_embedding():
    config = tiny_config("qwen2_vl")
    types, images, _, _ = PROMPTS["two images"]
    positions, _ = prompt_positions(types, images, [], MERGE)
    rotary: Any = modeling_qwen2_vl.Qwen2VLRotaryEmbedding(config.text_config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor(positions)[:, None, :])
    inv_freq = jnp.asarray(rotary.inv_freq.numpy())
    angles = np.asarray(mrope_angles(jnp.asarray(positions), inv_freq, SECTIONS))
    np.testing.assert_allclose(np.concatenate([np.cos(angles)] * 2, -1), cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(np.concatenate([np.sin(angles)] * 2, -1), sin[0].numpy(), atol=1e-6)


def test_text_only_prompt_is_plain_positions():
    positions, delta = prompt_positions([TEXT] * 7, [], [], MERGE)
    np.testing.assert_array_equal(positions, np.tile(np.arange(7), (3, 1)))
    assert delta == 0


def test_span_that_does_not_match_its_grid_is_refused():
    with pytest.raises(ValueError, match="does not match its grid"):
        prompt_positions([TEXT] + [IMAGE] * 5 + [TEXT], [(1, 4, 4)], [], MERGE)
    with pytest.raises(ValueError, match="more video spans"):
        prompt_positions([IMAGE] * 4 + [VIDEO] * 4, [(1, 4, 4)], [], MERGE)
