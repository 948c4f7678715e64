"""One step's batch: host-side ordering and packing, device-side input preparation.

The host orders the scheduled requests (decodes first), pads to the token
bucket and packs slots, scheduled counts and block appends into ONE int32
buffer. On the device, ``prepare_inputs`` turns that buffer and the request
state into input ids, positions, attention metadata and the rows to sample,
so decode inputs (the last sampled token) never leave the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxrunner.block_table import apply_block_appends, compute_slot_mapping
from jaxrunner.ops import AttentionMetadata
from jaxrunner.states import DeviceState


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static sizes of one token bucket's step program."""

    num_tokens: int  # the token bucket
    num_reqs: int  # request rows in the attention metadata: min(bucket, max_num_reqs)
    append_capacity: int  # block appends the step buffer carries

    @property
    def buffer_words(self) -> int:
        return 2 * self.num_reqs + 3 * self.append_capacity


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleRows:
    """Per scheduled request (padded to max_num_reqs): what the sampling step needs."""

    idx_mapping: Int[Array, "max_reqs"]  # request slot; max_num_reqs for padding
    num_scheduled: Int[Array, "max_reqs"]
    positions: Int[Array, "max_reqs"]  # position of the row's last input token
    is_sampling: Bool[Array, "max_reqs"]  # False mid chunked prefill and for padding


@dataclasses.dataclass
class InputBatch:
    """The host's view of one step's batch."""

    req_ids: list[str]
    idx_mapping_np: np.ndarray  # int32 [num_reqs]
    num_scheduled_tokens: np.ndarray  # int32 [num_reqs]
    num_tokens: int
    num_tokens_after_padding: int
    num_reqs_after_padding: int  # the request bucket of logits and sampling
    is_sampling_np: np.ndarray  # bool [num_reqs]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def pack_step_buffer(
    shape: StepShape, idx_mapping: np.ndarray, num_scheduled: np.ndarray, appends: np.ndarray,
    pad_slot: int,
) -> np.ndarray:
    """``[slots | scheduled counts | block-append triples]`` as one int32 buffer."""
    buf = np.zeros(shape.buffer_words, np.int32)
    n = len(idx_mapping)
    buf[: shape.num_reqs] = pad_slot
    buf[:n] = idx_mapping
    buf[shape.num_reqs : shape.num_reqs + n] = num_scheduled
    buf[2 * shape.num_reqs :] = appends.reshape(-1)
    return buf


def prepare_inputs(
    state: DeviceState, step_buffer: Int[Array, "words"], shape: StepShape, block_size: int
) -> tuple[DeviceState, Int[Array, "T"], Int[Array, "T"], AttentionMetadata, SampleRows]:
    """Input ids, positions, attention metadata and sample rows for one step (in jit)."""
    r = shape.num_reqs
    max_num_reqs = state.prefill_len.shape[0]
    idx_mapping = step_buffer[:r]
    num_scheduled = step_buffer[r : 2 * r]
    appends = step_buffer[2 * r :].reshape(3, shape.append_capacity)
    state = dataclasses.replace(state, block_table=apply_block_appends(state.block_table, appends))

    take = lambda a: a.at[idx_mapping].get(mode="fill", fill_value=0)
    num_computed = take(state.num_computed_tokens)
    prefill_len = take(state.prefill_len)
    query_start_loc = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(num_scheduled, dtype=jnp.int32)]
    )
    seq_lens = num_computed + num_scheduled
    total = query_start_loc[-1]

    token_index = jnp.arange(shape.num_tokens, dtype=jnp.int32)
    is_real = token_index < total
    token_req = jnp.clip(
        jnp.searchsorted(query_start_loc[1:], token_index, side="right"), 0, r - 1
    ).astype(jnp.int32)
    positions = num_computed[token_req] + token_index - query_start_loc[token_req]
    token_slot = idx_mapping[token_req]
    from_prefill = state.token_ids.at[token_slot, positions].get(mode="fill", fill_value=0)
    from_sampled = state.last_sampled_tokens.at[token_slot].get(mode="fill", fill_value=0)
    input_ids = jnp.where(positions < prefill_len[token_req], from_prefill, from_sampled)
    input_ids = jnp.where(is_real, input_ids, 0)
    slot_mapping = compute_slot_mapping(
        state.block_table, token_slot, positions, is_real, block_size
    )
    positions = jnp.where(is_real, positions, 0)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=state.block_table.at[idx_mapping].get(mode="fill", fill_value=0),
        slot_mapping=slot_mapping,
    )
    pad = max_num_reqs - r
    pad_rows = lambda a, fill: jnp.pad(a, (0, pad), constant_values=fill) if pad > 0 else a
    rows = SampleRows(
        idx_mapping=pad_rows(idx_mapping, max_num_reqs),
        num_scheduled=pad_rows(num_scheduled, 0),
        positions=pad_rows(jnp.maximum(seq_lens - 1, 0), 0),
        is_sampling=pad_rows((num_scheduled > 0) & (seq_lens >= prefill_len), False),
    )
    return state, input_ids, positions, metadata, rows


def logits_indices(metadata: AttentionMetadata) -> Int[Array, "num_reqs"]:
    """The packed index of each request's last scheduled token."""
    return jnp.maximum(metadata.query_start_loc[1:] - 1, 0)


def post_update(
    state: DeviceState, rows: SampleRows, sampled: Int[Array, "n"]
) -> DeviceState:
    """Advance computed counts; store, count and remember each sampled token (in jit)."""
    n = sampled.shape[0]
    idx = rows.idx_mapping[:n]
    sampling_rows = rows.is_sampling[:n]
    keep_old = state.last_sampled_tokens.at[idx].get(mode="fill", fill_value=0)
    # The sampled token sits at the position after the row's last input token.
    token_rows = jnp.where(sampling_rows, idx, state.token_ids.shape[0])
    return dataclasses.replace(
        state,
        token_ids=state.token_ids.at[token_rows, rows.positions[:n] + 1].set(sampled, mode="drop"),
        num_computed_tokens=state.num_computed_tokens.at[idx].add(rows.num_scheduled[:n], mode="drop"),
        last_sampled_tokens=state.last_sampled_tokens.at[idx].set(
            jnp.where(sampling_rows, sampled, keep_old), mode="drop"
        ),
        sampling=state.sampling.record_sampled(idx, sampled, sampling_rows),
    )
