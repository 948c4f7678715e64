"""Per-request runner state: slots on the host, the arrays they index on the device.

Every request the runner holds owns one slot (a row) in the device arrays.
The host keeps the slot bookkeeping and the few numbers it needs to build
outputs; prompts, counts and the last sampled tokens live on the device and
are advanced there by the step itself, so decode inputs never come from the host.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from jaxrunner.config import SamplerConfig
from jaxrunner.interfaces import NewRequestData
from jaxrunner.runner.mrope import prefill_mrope_positions
from jaxrunner.runner.packed_rows import RowLayout
from jaxrunner.runner.spec_decode.ngram import NO_DRAFT
from jaxrunner.sample.sampling_state import (
    SamplingArrays,
    pack_sampling_params,
    sampling_fields,
    uses_sampling_stages,
)


def new_request_layout(
    max_model_len: int, max_blocks: int, config: SamplerConfig, vocab_size: int, mrope: bool = False
) -> RowLayout:
    """The packed row of one new request: counts, its LoRA slot, sampling fields, block ids, tokens, and
    with ``mrope`` its M-RoPE prefill positions and delta (``jaxrunner.runner.mrope``)."""
    mrope_fields = (("mrope_positions", 3 * max_model_len, "i32"), ("mrope_delta", 1, "i32")) if mrope else ()
    return RowLayout(
        (("slot", 1, "i32"), ("prefill_len", 1, "i32"), ("num_computed", 1, "i32"), ("prompt_len", 1, "i32"))
        + (("lora_slot", 1, "i32"),)
        + sampling_fields(config, vocab_size)
        + (("block_ids", max_blocks, "i32"), ("tokens", max_model_len, "i32"))
        + mrope_fields
    )


NO_LORA = -1
"""A request's LoRA slot when it runs the base model alone (``LoRABatch``'s token slot likewise)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    """All per-request device arrays, donated to and returned by every step.

    ``token_ids`` holds each request's prefill tokens and then every sampled
    token at its position, so bad-word checks can look back at the history.
    """

    token_ids: Int[Array, "max_reqs max_model_len"]
    prefill_len: Int[Array, " max_reqs"]
    num_computed_tokens: Int[Array, " max_reqs"]
    last_sampled_tokens: Int[Array, " max_reqs"]
    block_table: Int[Array, "max_reqs max_blocks_per_req"]
    sampling: SamplingArrays
    # Drafts a proposer on the device left for each request's next step (NO_DRAFT: none, as in a new slot).
    draft_tokens: Int[Array, "max_reqs num_spec"]
    # Each request's LoRA adapter slot (``jaxrunner.runner.lora``; NO_LORA: the base model), read per token.
    lora_slots: Int[Array, " max_reqs"]
    # The KV cache scales in use (the model's and the drafter's ``KVScale`` variables): the loaded ones, or
    # pending ones the first writes set (``calculate_kv_scales``); they override the parameters' copies.
    kv_scales: nnx.State = dataclasses.field(default_factory=lambda: nnx.State({}))
    draft_kv_scales: nnx.State = dataclasses.field(default_factory=lambda: nnx.State({}))
    # M-RoPE models only (``jaxrunner.runner.mrope``): each request's prefill positions and decode delta.
    mrope_positions: Int[Array, "max_reqs 3 max_model_len"] | None = None
    mrope_delta: Int[Array, " max_reqs"] | None = None

    @classmethod
    def zeros(
        cls,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks: int,
        config: SamplerConfig,
        vocab_size: int,
        num_spec: int = 0,
        mrope: bool = False,
    ) -> DeviceState:
        """State for ``max_num_reqs`` slots, all unused (with ``mrope``, M-RoPE's positions too)."""
        return cls(
            token_ids=jnp.zeros((max_num_reqs, max_model_len), jnp.int32),
            prefill_len=jnp.zeros(max_num_reqs, jnp.int32),
            num_computed_tokens=jnp.zeros(max_num_reqs, jnp.int32),
            last_sampled_tokens=jnp.zeros(max_num_reqs, jnp.int32),
            block_table=jnp.zeros((max_num_reqs, max_blocks), jnp.int32),
            sampling=SamplingArrays.zeros(max_num_reqs, config, vocab_size),
            draft_tokens=jnp.full((max_num_reqs, num_spec), NO_DRAFT, jnp.int32),
            lora_slots=jnp.full(max_num_reqs, NO_LORA, jnp.int32),
            mrope_positions=jnp.zeros((max_num_reqs, 3, max_model_len), jnp.int32) if mrope else None,
            mrope_delta=jnp.zeros(max_num_reqs, jnp.int32) if mrope else None,
        )


def write_new_requests(state: DeviceState, rows: Int[Array, "n row_words"], layout: RowLayout) -> DeviceState:
    """Scatter packed new-request rows into their slots; padding rows (slot -1) are dropped."""
    fields = layout.unpack(rows)
    max_num_reqs = state.block_table.shape[0]
    slots = jnp.where(fields["slot"][:, 0] < 0, max_num_reqs, fields["slot"][:, 0])
    tokens, prefill_len = fields["tokens"], fields["prefill_len"][:, 0]
    set_rows = lambda old, new: old.at[slots].set(new, mode="drop")
    mrope_positions, mrope_delta = state.mrope_positions, state.mrope_delta
    if mrope_positions is not None and mrope_delta is not None:
        mrope_positions = set_rows(mrope_positions, fields["mrope_positions"].reshape(-1, *mrope_positions.shape[1:]))
        mrope_delta = set_rows(mrope_delta, fields["mrope_delta"][:, 0])
    return DeviceState(
        token_ids=set_rows(state.token_ids, tokens),
        prefill_len=set_rows(state.prefill_len, prefill_len),
        num_computed_tokens=set_rows(state.num_computed_tokens, fields["num_computed"][:, 0]),
        last_sampled_tokens=state.last_sampled_tokens,
        block_table=set_rows(state.block_table, fields["block_ids"]),
        sampling=state.sampling.write_rows(slots, fields, tokens, fields["prompt_len"][:, 0], prefill_len),
        draft_tokens=state.draft_tokens,
        lora_slots=set_rows(state.lora_slots, fields["lora_slot"][:, 0]),
        kv_scales=state.kv_scales,
        draft_kv_scales=state.draft_kv_scales,
        mrope_positions=mrope_positions,
        mrope_delta=mrope_delta,
    )


def _padded(ids: list[int], width: int) -> list[int]:
    return list(ids) + [0] * (width - len(ids))


class RequestState:
    """Slot bookkeeping on the host, and the packing of new requests for the device."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks: int,
        seed: int,
        sampler_config: SamplerConfig,
        vocab_size: int,
        mrope_merge_size: int | None = None,
        num_kv_cache_groups: int = 1,
    ):
        """``mrope_merge_size``: the vision tower's spatial merge size of an M-RoPE model (None: plain RoPE).
        ``max_blocks`` is each KV-cache group's; a row holds ``num_kv_cache_groups`` runs of them."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks
        self.num_kv_cache_groups = num_kv_cache_groups
        self.sampler_config = sampler_config
        self.vocab_size = vocab_size
        self.mrope_merge_size = mrope_merge_size
        self.layout = new_request_layout(
            max_model_len,
            max_blocks * num_kv_cache_groups,
            sampler_config,
            vocab_size,
            mrope=mrope_merge_size is not None,
        )
        self.req_id_to_index: dict[str, int] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.prefill_len = np.zeros(max_num_reqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_logprobs = np.zeros(max_num_reqs, np.int32)
        # Per slot, the running count of requests admitted when its request was: tells a request
        # from a later one in the same slot (a step's output may be read after its slot changed hands).
        self.admissions = np.zeros(max_num_reqs, np.int64)
        self._num_admitted = 0
        # Whether the slot's request samples from temperature alone (``uses_sampling_stages`` says no).
        self.plain_sampling = np.zeros(max_num_reqs, np.bool_)
        self._seed_rng = random.Random(seed)
        self._staged_rows: list[np.ndarray] = []

    def add_request(self, new_req: NewRequestData, lora_slot: int = NO_LORA) -> int:
        """Give a request a slot and stage its row (with its LoRA adapter's slot); checks what the device cannot."""
        req_id = new_req.req_id
        tokens = new_req.prefill_token_ids
        if req_id in self.req_id_to_index:
            raise ValueError(f"Request {req_id!r} is already running; finish it before re-adding it.")
        if not tokens:
            raise ValueError(f"Request {req_id!r} has an empty prompt; give it at least one token.")
        if len(tokens) > self.max_model_len:
            raise ValueError(
                f"Request {req_id!r} has {len(tokens)} prompt tokens, more than max_model_len "
                f"({self.max_model_len}). Shorten the prompt or raise ModelConfig.max_model_len."
            )
        groups = new_req.block_ids or ([],)
        if len(groups) != self.num_kv_cache_groups:
            raise ValueError(
                f"Request {req_id!r} has block ids for {len(groups)} KV-cache groups; the model has "
                f"{self.num_kv_cache_groups}."
            )
        if max(map(len, groups)) > self.max_blocks:
            raise ValueError(
                f"Request {req_id!r} has {max(map(len, groups))} KV blocks, more than the "
                f"{self.max_blocks} that max_model_len allows."
            )
        # Each group's run of columns, padded; one group's blocks as they are (the layout pads the row).
        block_ids = list(groups[0]) if len(groups) == 1 else [b for g in groups for b in _padded(g, self.max_blocks)]
        if not self._free_slots:
            raise ValueError(
                f"No free request slot for {req_id!r}: {self.max_num_reqs} requests are running "
                "(SchedulerConfig.max_num_seqs)."
            )
        sampling = pack_sampling_params(new_req.sampling_params, self._seed_rng, self.sampler_config, self.vocab_size)
        slot = self._free_slots.pop()
        self.req_id_to_index[req_id] = slot
        self._num_admitted += 1
        self.admissions[slot] = self._num_admitted
        self.prefill_len[slot] = len(tokens)
        self.num_computed_tokens[slot] = new_req.num_computed_tokens
        self.num_logprobs[slot] = sampling["num_logprobs"]
        self.plain_sampling[slot] = not uses_sampling_stages(sampling)
        mrope: dict[str, object] = {}
        if self.mrope_merge_size is not None:
            positions, delta = prefill_mrope_positions(new_req, self.mrope_merge_size)
            mrope = dict(mrope_positions=np.pad(positions, ((0, 0), (0, self.max_model_len - positions.shape[1]))))
            mrope["mrope_delta"] = delta
        self._staged_rows.append(
            self.layout.pack(
                dict(
                    slot=slot,
                    prefill_len=len(tokens),
                    num_computed=new_req.num_computed_tokens,
                    prompt_len=len(new_req.prompt_token_ids),
                    lora_slot=lora_slot,
                    block_ids=block_ids,
                    tokens=tokens,
                    **sampling,
                    **mrope,
                )
            )
        )
        return slot

    def remove_request(self, req_id: str) -> None:
        """Free the request's slot; unknown ids are ignored."""
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return
        self._free_slots.append(slot)

    def reset(self) -> None:
        """Every slot free and no row staged: the runner dropped all its requests."""
        self.req_id_to_index.clear()
        self._free_slots = list(range(self.max_num_reqs - 1, -1, -1))
        self._staged_rows = []

    def take_staged_rows(self, num_rows: int) -> np.ndarray | None:
        """The staged rows padded to ``num_rows`` (padding slot -1), or None if none are staged."""
        if not self._staged_rows:
            return None
        rows = np.tile(self.layout.pack({"slot": -1}), (num_rows, 1))
        rows[: len(self._staged_rows)] = self._staged_rows
        self._staged_rows = []
        return rows

    @property
    def num_staged(self) -> int:
        """Rows staged for the device and not written yet."""
        return len(self._staged_rows)


@runtime_checkable
class RequestFeatureState(Protocol):
    """One runner feature's per-request state, kept beside the slots (vLLM's ``gpu/sample/`` states).

    The runner hands every feature each new request with its slot, and each
    finished or preempted request's id. A feature whose state lives on the device
    stages the new rows in ``add_request`` and writes them with the step.
    """

    def add_request(self, new_req: NewRequestData, slot: int) -> None: ...

    def remove_request(self, req_id: str) -> None: ...
