"""One step's batch: the host packs it into one buffer, the step program builds its inputs from it.

The host (``ModelRunner.prepare_inputs``) orders the scheduled requests
(decodes first), pads to the token bucket and packs slots, scheduled counts and
block appends into ONE int32 buffer (``pack_step_buffer``). On the device,
``build_step_inputs`` turns that buffer and the request state into input ids,
positions, attention metadata and the rows to sample, so decode inputs (the
last sampled token) never leave the device.

Dimensions: T tokens (the token bucket), R request rows of the step, max_reqs
request slots, S drafts per request.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxrunner.models.kv_cache_groups import KVCacheGroups
from jaxrunner.ops import AttentionMetadata
from jaxrunner.runner.block_table import apply_block_appends, compute_slot_mapping, group_columns
from jaxrunner.runner.mrope import mrope_positions
from jaxrunner.runner.states import NO_LORA, DeviceState


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static sizes of one token bucket's step program."""

    num_tokens: int  # the token bucket
    num_reqs: int  # request rows in the attention metadata: min(bucket, max_num_reqs)
    append_capacity: int  # block appends the step buffer carries
    num_spec: int = 0  # draft tokens per request at most (speculative decoding)
    drafts_on_device: bool = False  # a proposer on the device left them in DeviceState.draft_tokens
    multimodal: bool = False  # the buffer carries each token's encoder cache row (vision-language models)

    @property
    def buffer_words(self) -> int:
        """int32 words of the packed per-step buffer for this shape."""
        mm_words = self.num_tokens if self.multimodal else 0
        return (3 + self.num_spec) * self.num_reqs + 3 * self.append_capacity + mm_words

    @property
    def encoder_rows_start(self) -> int:
        return (3 + self.num_spec) * self.num_reqs + 3 * self.append_capacity


NO_ENCODER_ROW = -1
"""A token's encoder cache row when it is not an image placeholder: its embedding is its token's."""


class StepInputs(NamedTuple):
    """What the forward step reads, built on the device from the step buffer and the request state."""

    input_ids: Int[Array, " num_tokens"]
    positions: Int[Array, " num_tokens"]  # each token's position in its request
    model_positions: Int[Array, " num_tokens"] | Int[Array, "3 num_tokens"]  # RoPE's: M-RoPE's three rows
    metadata: AttentionMetadata | tuple[AttentionMetadata, ...]  # one per KV-cache group where several
    rows: SampleRows
    row_index: Int[Array, "num_rows num_spec_plus_1"]  # the packed token of each logits row
    token_lora_slots: Int[Array, " num_tokens"]  # its request's LoRA slot (NO_LORA for padding)
    encoder_rows: Int[Array, " num_tokens"] | None  # encoder cache row or NO_ENCODER_ROW; None: text model


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleRows:
    """Per scheduled request (padded to max_num_reqs): what the sampling step needs."""

    idx_mapping: Int[Array, " max_reqs"]  # request slot; max_num_reqs for padding
    num_scheduled: Int[Array, " max_reqs"]
    num_drafts: Int[Array, " max_reqs"]
    draft_tokens: Int[Array, "max_reqs num_spec"]
    # Input position of each logits row: row j scores the token after draft j - 1
    # (row 0: after the last sampled or prompt token). Rows past num_drafts are padding.
    positions: Int[Array, "max_reqs num_spec_plus_1"]
    is_sampling: Bool[Array, " max_reqs"]  # False mid chunked prefill and for padding

    @classmethod
    def abstract(cls, max_num_reqs: int, num_spec: int) -> SampleRows:
        """Shapes and dtypes of the rows, for lowering the sampling programs."""
        i32 = lambda *shape: jnp.zeros((max_num_reqs, *shape), jnp.int32)
        return jax.eval_shape(
            lambda: cls(
                idx_mapping=i32(),
                num_scheduled=i32(),
                num_drafts=i32(),
                draft_tokens=i32(num_spec),
                positions=i32(num_spec + 1),
                is_sampling=jnp.zeros(max_num_reqs, jnp.bool_),
            )
        )


@dataclasses.dataclass
class InputBatch:
    """The host's view of one step's batch."""

    req_ids: list[str]
    idx_mapping_np: np.ndarray  # int32 [num_reqs]
    admissions_np: np.ndarray  # int64 [num_reqs]: which admission to its slot each request is (RequestState)
    num_scheduled_tokens: np.ndarray  # int32 [num_reqs]
    num_tokens_after_padding: int  # the token bucket
    num_reqs_after_padding: int  # the request bucket of logits and sampling
    is_sampling_np: np.ndarray  # bool [num_reqs]
    num_drafts: np.ndarray  # int32 [num_reqs]: draft tokens to verify
    num_steps: int = 1  # decode steps of the round; num_scheduled_tokens counts one step's tokens

    @property
    def num_reqs(self) -> int:
        """Requests in the batch, before padding."""
        return len(self.req_ids)


def pack_step_buffer(
    shape: StepShape,
    idx_mapping: np.ndarray,
    num_scheduled: np.ndarray,
    drafts: list[list[int]],
    appends: np.ndarray,
    pad_slot: int,
    encoder_rows: np.ndarray | None = None,
) -> np.ndarray:
    """``[slots | scheduled counts | draft counts | drafts | block-append triples | encoder rows]``, one int32
    buffer; the last part only for a multimodal shape (``encoder_rows``: each token's, none for padding).

    ``drafts`` holds each request's draft tokens, or nothing when no request has any.
    """
    r, k, n = shape.num_reqs, shape.num_spec, len(idx_mapping)
    buffer = np.zeros(shape.buffer_words, np.int32)  # each part is written through a view of it
    slots, scheduled, num_drafts = buffer[:r], buffer[r : 2 * r], buffer[2 * r : 3 * r]
    draft_tokens = buffer[3 * r : (3 + k) * r].reshape(r, k)
    slots[:n] = idx_mapping
    slots[n:] = pad_slot
    scheduled[:n] = num_scheduled
    for i, tokens in enumerate(drafts):
        if tokens:  # most rows have none: skip their (slow, small) numpy writes
            num_drafts[i] = len(tokens)
            draft_tokens[i, : len(tokens)] = tokens
    buffer[(3 + k) * r : shape.encoder_rows_start] = appends.reshape(-1)
    if shape.multimodal:
        mm = buffer[shape.encoder_rows_start :]
        mm[:] = NO_ENCODER_ROW
        if encoder_rows is not None:
            mm[: encoder_rows.size] = encoder_rows
    return buffer


def build_step_inputs(
    state: DeviceState,
    step_buffer: Int[Array, " buffer_words"],
    shape: StepShape,
    block_size: int,
    kv_cache_groups: KVCacheGroups | None = None,
) -> tuple[DeviceState, StepInputs]:
    """The step's ``StepInputs`` from the step buffer and the request state (in jit); the state gets the
    step's block appends. With ``kv_cache_groups`` the metadata is one per group, each from its group's
    columns of the block table.

    A request with drafts is decoding: its first query token is its last
    sampled token and the next ``num_drafts`` are the drafts, to be verified.
    """
    r, k = shape.num_reqs, shape.num_spec
    max_num_reqs = state.prefill_len.shape[0]
    idx_mapping = step_buffer[:r]
    num_scheduled = step_buffer[r : 2 * r]
    num_drafts = step_buffer[2 * r : 3 * r]
    draft_tokens = step_buffer[3 * r : (3 + k) * r].reshape(r, k)
    appends = step_buffer[(3 + k) * r : shape.encoder_rows_start].reshape(3, shape.append_capacity)
    state = dataclasses.replace(state, block_table=apply_block_appends(state.block_table, appends))

    take = lambda a: a.at[idx_mapping].get(mode="fill", fill_value=0)
    num_computed = take(state.num_computed_tokens)
    prefill_len = take(state.prefill_len)
    query_start_loc = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_scheduled, dtype=jnp.int32)])
    seq_lens = num_computed + num_scheduled
    total = query_start_loc[-1]

    token_index = jnp.arange(shape.num_tokens, dtype=jnp.int32)
    is_real = token_index < total
    # compare_all: one fused comparison; the default binary search is a loop, whose condition XLA reads
    # back on the host at every iteration (the only loop the batch-64 forward had).
    token_req = jnp.clip(
        jnp.searchsorted(query_start_loc[1:], token_index, side="right", method="compare_all"), 0, r - 1
    ).astype(jnp.int32)
    offset = token_index - query_start_loc[token_req]
    positions = num_computed[token_req] + offset
    token_slot = idx_mapping[token_req]
    from_prefill = state.token_ids.at[token_slot, positions].get(mode="fill", fill_value=0)
    from_sampled = state.last_sampled_tokens.at[token_slot].get(mode="fill", fill_value=0)
    input_ids = jnp.where(positions < prefill_len[token_req], from_prefill, from_sampled)
    if k:
        if shape.drafts_on_device:
            draft_tokens = state.draft_tokens.at[idx_mapping].get(mode="fill", fill_value=0)
        # A draft the proposer could not fill (-1) is never accepted; its input is any valid token.
        from_draft = jnp.maximum(draft_tokens.at[token_req, offset - 1].get(mode="fill", fill_value=0), 0)
        input_ids = jnp.where((offset > 0) & (num_drafts[token_req] > 0), from_draft, input_ids)
    input_ids = jnp.where(is_real, input_ids, 0)
    token_lora_slots = jnp.where(is_real, state.lora_slots.at[token_slot].get(mode="fill", fill_value=NO_LORA), NO_LORA)
    num_groups = 1 if kv_cache_groups is None else kv_cache_groups.num_groups
    tables = [group_columns(state.block_table, g, num_groups) for g in range(num_groups)]
    group_metadata = tuple(
        AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=table.at[idx_mapping].get(mode="fill", fill_value=0),
            slot_mapping=compute_slot_mapping(table, token_slot, positions, is_real, block_size),
        )
        for table in tables
    )
    positions = jnp.where(is_real, positions, 0)
    model_positions = positions
    if state.mrope_positions is not None and state.mrope_delta is not None:
        model_positions = mrope_positions(
            state.mrope_positions, state.mrope_delta, prefill_len[token_req], token_slot, positions
        )
    metadata = group_metadata[0] if kv_cache_groups is None else group_metadata
    # Logits row j of request r: packed index of its draft j - 1 (row 0: the token before the drafts).
    j = jnp.arange(k + 1)[None, :]
    first_row = query_start_loc[1:, None] - 1 - num_drafts[:, None]
    row_index = jnp.where(j <= num_drafts[:, None], first_row + j, query_start_loc[1:, None] - 1)
    row_positions = (seq_lens - 1 - num_drafts)[:, None] + jnp.minimum(j, num_drafts[:, None])
    pad = max_num_reqs - r
    pad_rows = lambda a, fill: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill) if pad else a
    rows = SampleRows(
        idx_mapping=pad_rows(idx_mapping, max_num_reqs),
        num_scheduled=pad_rows(num_scheduled, 0),
        num_drafts=pad_rows(num_drafts, 0),
        draft_tokens=pad_rows(draft_tokens, 0),
        positions=pad_rows(jnp.maximum(row_positions, 0), 0),
        is_sampling=pad_rows((num_scheduled > 0) & (seq_lens >= prefill_len), False),
    )
    encoder_rows = step_buffer[shape.encoder_rows_start :] if shape.multimodal else None
    return state, StepInputs(
        input_ids,
        positions,
        model_positions,
        metadata,
        rows,
        jnp.maximum(row_index, 0),
        token_lora_slots,
        encoder_rows,
    )


def post_update(
    state: DeviceState,
    rows: SampleRows,
    output_tokens: Int[Array, "num_rows num_spec_plus_1"],
    num_sampled: Int[Array, " num_rows"],
) -> DeviceState:
    """Advance computed counts by the accepted tokens; store, count and remember them (in jit).

    A row that samples emits ``num_sampled`` tokens (accepted drafts + 1);
    its rejected drafts' positions are recomputed next step.
    """
    n, k1 = output_tokens.shape
    idx = rows.idx_mapping[:n]
    sampling_rows = rows.is_sampling[:n]
    num_sampled = jnp.where(sampling_rows, num_sampled, 0)
    rejected = jnp.where(sampling_rows, rows.num_drafts[:n] - (num_sampled - 1), 0)
    emitted = jnp.arange(k1)[None, :] < num_sampled[:, None]
    last = jnp.take_along_axis(output_tokens, jnp.maximum(num_sampled - 1, 0)[:, None], axis=1)[:, 0]
    keep_old = state.last_sampled_tokens.at[idx].get(mode="fill", fill_value=0)
    # Output token j sits after the row's first input position, at position + 1 + j.
    token_rows = jnp.where(emitted, idx[:, None], state.token_ids.shape[0])
    token_pos = rows.positions[:n, :1] + 1 + jnp.arange(k1)[None, :]
    sampling = state.sampling
    for j in range(k1):
        sampling = sampling.record_sampled(idx, output_tokens[:, j], emitted[:, j])
    return dataclasses.replace(
        state,
        token_ids=state.token_ids.at[token_rows, token_pos].set(output_tokens, mode="drop"),
        num_computed_tokens=state.num_computed_tokens.at[idx].add(rows.num_scheduled[:n] - rejected, mode="drop"),
        last_sampled_tokens=state.last_sampled_tokens.at[idx].set(
            jnp.where(sampling_rows, last, keep_old), mode="drop"
        ),
        sampling=sampling,
    )
