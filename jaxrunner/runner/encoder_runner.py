"""The multimodal encoder in the runner (vLLM's ``EncoderRunner``): images encoded into a device cache,
their rows gathered into the step's input embeddings.

The encoder cache is one device array of ``encoder_cache_size`` rows, one
embedding a row; each cached image holds the rows of its placeholder tokens,
anywhere in the array (a free list of rows, so no image waits for a contiguous
run). The scheduler's ``EncoderCacheManager`` decides what is cached: the runner
encodes what ``scheduled_encoder_inputs`` names and frees what
``free_encoder_mm_hashes`` names, so both sides always agree and the free list
never runs dry. An image is encoded by the ``encode_image`` program of its patch
bucket, one image a call, straight into its rows; the forward step then reads
each placeholder token's row (``StepInputs.encoder_rows``) in place of its
token embedding.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import RunnerConfig
from jaxrunner.interfaces import NewRequestData
from jaxrunner.models.qwen2_vl_vision import VisionConfig, frame_ids, patch_positions, window_ids
from jaxrunner.models.transformer import TransformerConfig
from jaxrunner.multimodal.inputs import ImagePatches, MultiModalFeatureSpec
from jaxrunner.runner.compilation import CompilationManager
from jaxrunner.runner.input_batch import NO_ENCODER_ROW
from jaxrunner.runner.unsupported import refuse_combinations

NO_FRAME = -1
"""The frame (and window) id of a bucket's padding patches: a frame of their own, attending among themselves."""


def check_multimodal_support(config: RunnerConfig, arch: TransformerConfig) -> None:
    """NotImplementedError naming what a vision-language model cannot be served with yet."""
    if arch.vision is None:
        return
    unsupported = [
        ("speculative decoding", config.speculative_config is not None),
        ("LoRA adapters (enable_lora)", config.lora_config is not None),
        ("tensor parallelism", config.parallel_config.tensor_parallel_size > 1),
    ]
    refuse_combinations("A vision-language model", unsupported, "serve it without, or serve a text model.")


class EncoderRunner:
    """Per-request images, the device encoder cache and its rows, and the encoder's calls."""

    def __init__(
        self,
        cache_size: int,
        hidden_size: int,
        dtype,
        vision: VisionConfig,
        sharding: jax.sharding.Sharding,
    ):
        self.cache_size = cache_size
        self.vision = vision
        self.merge_area = vision.spatial_merge_size**2
        self.cache = jax.device_put(jnp.zeros((cache_size, hidden_size), dtype), sharding)
        self.rows: dict[str, np.ndarray] = {}  # content hash -> the image's rows, in placeholder order
        self._free_rows = np.arange(cache_size, dtype=np.int32)[::-1].tolist()
        self.req_features: dict[str, list[MultiModalFeatureSpec]] = {}
        self.num_encoded = 0  # images encoded so far

    # ------------------------------------------------------------ requests

    def add_request(self, new_req: NewRequestData, slot: int) -> None:
        if new_req.mm_features:
            self.req_features[new_req.req_id] = new_req.mm_features

    def remove_request(self, req_id: str) -> None:
        self.req_features.pop(req_id, None)

    def free_encoder_cache(self, mm_hash: str) -> None:
        """Give the image's rows back (the scheduler dropped it); unknown hashes are ignored."""
        rows = self.rows.pop(mm_hash, None)
        if rows is not None:
            self._free_rows.extend(rows.tolist())

    def reset(self, lost: bool) -> None:
        """Forget every cached image (``lost``: the cache array was donated to a call cut short; make it again)."""
        self.rows.clear()
        self.req_features.clear()
        self._free_rows = np.arange(self.cache_size, dtype=np.int32)[::-1].tolist()
        if lost:
            self.cache = jax.device_put(jnp.zeros(self.cache.shape, self.cache.dtype), self.cache.sharding)

    @property
    def num_cached_rows(self) -> int:
        """Rows that hold an image's embeddings."""
        return self.cache_size - len(self._free_rows)

    # ------------------------------------------------------------- encoder

    def execute_mm_encoder(
        self, scheduled_encoder_inputs: dict[str, list[int]], compilation: CompilationManager, call: Callable
    ) -> None:
        """Encode the step's scheduled images not cached yet, each into rows of its own."""
        for req_id, input_ids in scheduled_encoder_inputs.items():
            features = self.req_features.get(req_id)
            if features is None:
                raise ValueError(f"Request {req_id!r} has encoder inputs scheduled but no multimodal features.")
            for input_id in input_ids:
                feature = features[input_id]
                if feature.identifier not in self.rows:
                    self._encode(feature, compilation, call)

    def _encode(self, feature: MultiModalFeatureSpec, compilation: CompilationManager, call: Callable) -> None:
        if feature.num_embeds > len(self._free_rows):
            raise RuntimeError(
                f"The encoder cache has {len(self._free_rows)} free rows for an image of {feature.num_embeds}: "
                "the scheduler's encoder cache manager and the runner disagree."
            )
        rows = np.array([self._free_rows.pop() for _ in range(feature.num_embeds)], np.int32)
        bucket = compilation.patch_bucket(feature.data.num_patches)
        program = compilation.encode_image.get(bucket)
        self.cache = call(program, self.cache, *self.encode_image_inputs(feature.data, bucket, rows))
        self.rows[feature.identifier] = rows
        self.num_encoded += 1

    def encode_image_inputs(
        self, image: ImagePatches, bucket: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``encode_image``'s inputs for one image padded to ``bucket`` patches: its patches, their positions,
        frames and windows (padding a frame of its own), and the cache rows of its tokens (padding's past the
        cache, dropped)."""
        grid = [image.grid_thw]
        pad = bucket - image.num_patches
        pad_int = lambda a, value: np.pad(
            a.astype(np.int32), [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=value
        )
        return (
            np.pad(image.pixel_values, ((0, pad), (0, 0))),
            pad_int(patch_positions(grid, self.vision.spatial_merge_size), 0),
            pad_int(frame_ids(grid), NO_FRAME),
            pad_int(window_ids(grid, self.vision), NO_FRAME),
            np.pad(rows, (0, bucket // self.merge_area - rows.size), constant_values=self.cache_size),
        )

    # -------------------------------------------------------------- gather

    def gather_mm_embeddings(
        self, req_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray
    ) -> np.ndarray | None:
        """Each of the step's tokens' encoder cache row (``NO_ENCODER_ROW`` for text), in batch order; None
        when no token is an image's."""
        encoder_rows = None
        start = 0
        for req_id, n, computed in zip(req_ids, num_scheduled.tolist(), num_computed.tolist()):
            for feature in self.req_features.get(req_id, ()):
                position = feature.mm_position
                lo, hi = max(computed, position.offset), min(computed + n, position.end)
                if lo >= hi:
                    continue
                rows = self.rows.get(feature.identifier)
                if rows is None:
                    raise RuntimeError(
                        f"Request {req_id!r} needs image {feature.identifier} at tokens {lo}..{hi - 1}, which the "
                        "encoder cache does not hold: it must be scheduled in scheduled_encoder_inputs first."
                    )
                if encoder_rows is None:
                    encoder_rows = np.full(int(num_scheduled.sum()), NO_ENCODER_ROW, np.int32)
                encoder_rows[start + lo - computed : start + hi - computed] = rows[
                    lo - position.offset : hi - position.offset
                ]
            start += n
        return encoder_rows
