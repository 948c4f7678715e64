"""M-RoPE, the multimodal rotary positions of Qwen2-VL and Qwen2.5-VL: three position rows a token.

A text token's three rows are equal (its 1-D position); an image's or a video's
placeholder tokens take (temporal, height, width) positions from the grid of merged
patches, offset by where the span starts, and the text after the span continues
from past the grid's largest spatial extent. A prompt's positions therefore end
below its length, by ``delta`` (negative): decode positions are ``position + delta``
in all three rows. The rotary angles then take each frequency's position from one
row: the head's frequencies are cut into ``mrope_section`` (temporal, height,
width) runs. Positions follow transformers' ``get_rope_index`` (v5) exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

TEXT, IMAGE, VIDEO = 0, 1, 2
"""Token types: what each prompt token is (``mm_token_type_ids`` in transformers' processors)."""


def vision_positions(
    start: int, grid_thw: Sequence[int], spatial_merge_size: int, time_interval: float = 1.0
) -> Int[np.ndarray, "3 span_len"]:
    """The positions of one image's or video's placeholder tokens: (temporal, height, width) over the grid of
    merged patches (``grid_thw`` counts patches before merging), offset by ``start``; a video's temporal
    position steps by ``time_interval`` a frame (truncated to an integer, as transformers does)."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // spatial_merge_size, int(grid_thw[2]) // spatial_merge_size
    temporal = (np.arange(t) * time_interval).astype(np.int64)
    grid = np.meshgrid(temporal, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([axis.reshape(-1) for axis in grid]) + start


def prompt_positions(
    token_types: Sequence[int],
    image_grids: Sequence[Sequence[int]],
    video_grids: Sequence[Sequence[int]],
    spatial_merge_size: int,
    video_intervals: Sequence[float] = (),
) -> tuple[Int[np.ndarray, "3 prompt_len"], int]:
    """A prompt's M-RoPE positions and its ``delta`` (decode positions are ``position + delta``).

    ``token_types`` gives each prompt token's type (``TEXT``, ``IMAGE`` or ``VIDEO``); each run of
    image (video) tokens is one image (video), whose grid is the next of ``image_grids``
    (``video_grids``) and, for a video, whose temporal step is the next of ``video_intervals``
    (Qwen2.5-VL's ``tokens_per_second x second_per_grid_t``; 1 where not given, as in Qwen2-VL).
    """
    grid_iters = {IMAGE: iter(image_grids), VIDEO: iter(video_grids)}
    interval_iter = iter(video_intervals)
    spans, offset = [], 0
    for kind, run in itertools.groupby(token_types):
        length = len(list(run))
        if kind != TEXT:
            grid = next(grid_iters[kind], None)
            if grid is None:
                name, count = ("image", len(image_grids)) if kind == IMAGE else ("video", len(video_grids))
                raise ValueError(f"the prompt has more {name} spans than the {count} {name} grids given")
            interval = next(interval_iter, 1.0) if kind == VIDEO else 1.0
            spans.append(VisionSpan(offset, length, tuple(int(n) for n in grid), interval))
        offset += length
    return span_positions(len(token_types), spans, spatial_merge_size)


@dataclasses.dataclass(frozen=True)
class VisionSpan:
    """An image's or a video's placeholder tokens in a prompt: ``length`` from ``offset``, over ``grid_thw``
    (patches before merging), a video's frames ``time_interval`` apart."""

    offset: int
    length: int
    grid_thw: tuple[int, ...]
    time_interval: float = 1.0


def span_positions(
    num_tokens: int, spans: Sequence[VisionSpan], spatial_merge_size: int
) -> tuple[Int[np.ndarray, "3 num_tokens"], int]:
    """The M-RoPE positions and ``delta`` of ``num_tokens`` prompt tokens, text but for ``spans`` (in order)."""
    rows, position, offset = [], 0, 0
    for span in [*spans, VisionSpan(num_tokens, 0, (0, 0, 0))]:
        text = span.offset - offset
        if text < 0:
            raise ValueError(f"vision spans overlap or are out of order at token {span.offset}")
        rows.append(np.broadcast_to(np.arange(text) + position, (3, text)))
        position += text
        if not span.length:
            break
        positions = vision_positions(position, span.grid_thw, spatial_merge_size, span.time_interval)
        if positions.shape[1] != span.length:
            raise ValueError(
                f"a span of {span.length} placeholder tokens does not match its grid {span.grid_thw}, which "
                f"merges into {positions.shape[1]} tokens (spatial_merge_size {spatial_merge_size})"
            )
        rows.append(positions)
        position += max(span.grid_thw[1], span.grid_thw[2]) // spatial_merge_size
        offset = span.offset + span.length
    positions = np.concatenate(rows, axis=1)
    delta = int(positions.max()) + 1 - positions.shape[1] if positions.size else 0
    return positions.astype(np.int64), delta


def mrope_angles(
    positions: Int[Array, "3 num_tokens"], inv_freq: Float[Array, " half_head_dim"], sections: Sequence[int]
) -> Float[Array, "num_tokens half_head_dim"]:
    """The rotary angles of every token: frequency ``j`` of section ``i`` (temporal, height, width, in
    turn) turns by the token's row ``i % 3`` position."""
    if sum(sections) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {list(sections)} must sum to head_dim / 2 = {inv_freq.shape[0]}")
    row_of_freq = np.repeat(np.arange(len(sections)) % 3, sections)
    return positions[row_of_freq].T.astype(jnp.float32) * inv_freq[None, :]
