"""Qwen2-VL's and Qwen2.5-VL's vision transformers against transformers': the same random weights, images and
a video packed together, the merged tokens compared (float32)."""

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from test_model_parity import rel_err
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl

from jaxrunner.models.qwen2_vl_vision import VisionConfig, VisionTransformer, frame_ids, patch_positions, window_ids

# Two images and a two-frame video, in patches of 4 pixels; Qwen2.5-VL's windows of 16 pixels are 2 x 2 merge
# windows, so the 8 x 12 image holds six windows and the others one each (partial windows at the edges).
GRIDS = [(1, 8, 12), (2, 4, 4), (1, 2, 6)]
SHAPE = dict(num_heads=4, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)


def hf_vision(family: str) -> Any:
    if family == "qwen2_5_vl":
        vision = dict(
            depth=3, hidden_size=32, out_hidden_size=48, intermediate_size=40, window_size=16,
            fullatt_block_indexes=[1], **SHAPE,
        )  # fmt: skip
        config: Any = transformers.Qwen2_5_VLConfig(vision_config=vision).vision_config
        tower = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=48, mlp_ratio=2, **SHAPE)
        config = transformers.Qwen2VLConfig(vision_config=vision).vision_config
        tower = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
    torch.manual_seed(0)
    model = tower(config).eval()
    with torch.no_grad():  # HF initialises biases and norms to constants: make every parameter matter
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def load_hf_weights(model: VisionTransformer, hf_model: Any) -> None:
    """HF's tensors into the NNX model by name: a Linear's ``weight`` is our ``kernel`` transposed, the patch
    embedding's Conv3d weight flattened first."""
    state = nnx.state(model)
    flat = dict(nnx.to_flat_state(state))
    for name, tensor in hf_model.state_dict().items():
        path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
        value = tensor.numpy()
        if path[-1] == "weight" and value.ndim >= 2:
            path = (*path[:-1], "kernel")
            value = value.reshape(value.shape[0], -1).T
        flat[path].set_value(jnp.asarray(value))
    nnx.update(model, state)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_merged_tokens_match_transformers(family):
    hf_model = hf_vision(family)
    config = VisionConfig.from_hf(hf_model.config)
    model = VisionTransformer(config, rngs=nnx.Rngs(0))
    load_hf_weights(model, hf_model)
    num_patches = sum(t * h * w for t, h, w in GRIDS)
    patches = np.random.default_rng(1).normal(size=(num_patches, config.patch_features)).astype(np.float32)

    with torch.no_grad():
        ref = hf_model(torch.tensor(patches), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    positions = jnp.asarray(patch_positions(GRIDS, config.spatial_merge_size))
    frames, windows = jnp.asarray(frame_ids(GRIDS)), jnp.asarray(window_ids(GRIDS, config))
    ours = np.asarray(model(jnp.asarray(patches), positions, frames, windows))
    assert ours.shape == ref.shape == (num_patches // 4, 48)
    assert rel_err(ours, ref) < 1e-4, rel_err(ours, ref)
