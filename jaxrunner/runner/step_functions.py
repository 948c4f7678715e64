"""The pure functions the runner compiles: one forward step, one sampling step, prompt logprobs.

They close over nothing but ``StepStatics`` (graphs, static sizes, the attention
backend); the parameters, KV caches and device state are arguments, so each
bucket compiles to one program and the caches and state can be donated.

Dimensions: T tokens (the token bucket), R request rows (the request bucket),
max_reqs request slots, S drafts per request, E hidden, W grammar bitmask words.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrunner.config import SamplerConfig
from jaxrunner.models import CausalLM
from jaxrunner.models.eagle import EagleHead
from jaxrunner.models.kv_cache_groups import KVCacheGroups
from jaxrunner.models.lora import LoRABatch, LoRAWeights
from jaxrunner.models.qwen2_vl import VisionLanguageLM
from jaxrunner.models.transformer import KVScale
from jaxrunner.ops import AttentionBackend, AttentionMetadata
from jaxrunner.runner.input_batch import SampleRows, StepShape, build_step_inputs, post_update
from jaxrunner.runner.kv_cache import KVCaches
from jaxrunner.runner.spec_decode.drafter import Drafter
from jaxrunner.runner.spec_decode.ngram import NgramDrafter, num_valid_drafts
from jaxrunner.runner.states import DeviceState
from jaxrunner.sample.logprobs import LogprobsTensors, compute_logprobs
from jaxrunner.sample.rejection_sampler import rejection_sample
from jaxrunner.sample.sampler import logprobs_of, prepare_logits, sample

ParamLeaves = list[jax.Array]
"""A module's parameters as the flat list of their leaves."""


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """What the step functions need that is not an array.

    Parameters travel as flat lists of leaves: a call then flattens a list, not
    the model's tree of NNX variables (about 0.5 ms a call for 32 layers).
    """

    graphdef: nnx.GraphDef
    params_treedef: Any
    draft_params_treedef: Any
    drafter: Drafter | None  # proposes drafts on the device
    attention_backend: AttentionBackend  # the attention ops' implementation, resolved for the runner's mesh
    block_size: int
    max_num_reqs: int
    num_spec: int
    sampler_config: SamplerConfig
    ngram: NgramDrafter | None = None  # proposes n-gram drafts on the device (method "ngram_gpu")
    kv_cache_groups: KVCacheGroups | None = None  # several groups' block tables (None: one, a tensor a layer)

    @property
    def num_kv_cache_groups(self) -> int:
        return 1 if self.kv_cache_groups is None else self.kv_cache_groups.num_groups

    @property
    def drafts_on_device(self) -> bool:
        """Whether the sampling program leaves the next step's drafts in ``DeviceState.draft_tokens``."""
        return self.drafter is not None or self.ngram is not None

    def model(self, param_leaves: ParamLeaves, kv_scales: nnx.State | None = None) -> CausalLM:
        """The model, rebuilt from its graph and the flat parameter leaves, with ``kv_scales`` (the
        device state's) for the parameters' KV cache scales where given."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.params_treedef, param_leaves))
        if kv_scales is not None:
            nnx.update(model, kv_scales)
        return model

    def draft_module(self, draft_leaves: ParamLeaves, kv_scales: nnx.State) -> CausalLM | EagleHead:
        """The drafter's module, rebuilt from its graph and flat parameter leaves, with ``kv_scales``."""
        assert self.drafter is not None
        module = nnx.merge(self.drafter.graphdef, jax.tree.unflatten(self.draft_params_treedef, draft_leaves))
        nnx.update(module, kv_scales)
        return module


def forward(
    statics: StepStatics,
    param_leaves: ParamLeaves,
    draft_leaves: ParamLeaves,
    kv_caches: KVCaches,
    draft_kv: KVCaches,
    state: DeviceState,
    step_buffer: Int[Array, " buffer_words"],
    lora_weights: LoRAWeights | None,
    encoder_cache: Float[Array, "encoder_cache_size hidden_size"] | None,
    *,
    shape: StepShape,
) -> tuple[
    KVCaches,
    KVCaches,
    DeviceState,
    Float[Array, "max_reqs num_spec_plus_1 hidden_size"],
    SampleRows,
    Float[Array, "num_tokens hidden_size"],
]:
    """The step's inputs from its buffer, the model (and the drafter's pass), and the hidden rows to sample.

    With ``lora_weights`` (the LoRA slots; None: LoRA off) each token adds its request's adapter; with
    ``encoder_cache`` (a vision-language model's encoder outputs) each image placeholder takes its row.
    """
    model = statics.model(param_leaves, state.kv_scales)
    state, inputs = build_step_inputs(state, step_buffer, shape, statics.block_size, statics.kv_cache_groups)
    input_ids, positions, metadata, rows = inputs.input_ids, inputs.positions, inputs.metadata, inputs.rows
    lora = None if lora_weights is None else LoRABatch(lora_weights, inputs.token_lora_slots)
    embeds = None
    if encoder_cache is not None and inputs.encoder_rows is not None:
        embeds = embed_with_encoder_outputs(model, input_ids, encoder_cache, inputs.encoder_rows)
    hidden, kv_caches = model(
        input_ids,
        inputs.model_positions,
        kv_caches,
        metadata,
        statics.attention_backend,
        lora,
        inputs_embeds=embeds,
        kv_cache_groups=statics.kv_cache_groups,
    )
    state = dataclasses.replace(state, kv_scales=nnx.state(model, KVScale))
    if statics.drafter is not None:
        assert isinstance(metadata, AttentionMetadata)  # a drafter runs with one KV-cache group only
        drafter = statics.draft_module(draft_leaves, state.draft_kv_scales)
        draft_kv = statics.drafter.on_step(
            drafter, draft_kv, model, input_ids, positions, metadata, hidden, statics.attention_backend
        )
        state = dataclasses.replace(state, draft_kv_scales=nnx.state(drafter, KVScale))
    sample_hidden = hidden[inputs.row_index]  # [requests, 1 + drafts, hidden]
    pad = statics.max_num_reqs - shape.num_reqs
    sample_hidden = jnp.pad(sample_hidden, ((0, pad), (0, 0), (0, 0)))
    return kv_caches, draft_kv, state, sample_hidden, rows, hidden


def sample_step(
    statics: StepStatics,
    param_leaves: ParamLeaves,
    draft_leaves: ParamLeaves,
    draft_kv: KVCaches,
    sample_hidden: Float[Array, "max_reqs num_spec_plus_1 hidden_size"],
    rows: SampleRows,
    state: DeviceState,
    grammar_bitmask: Int[Array, "num_logits_rows bitmask_words"] | None,
    grammar_active: Bool[Array, " num_logits_rows"] | None,
    *,
    num_rows: int,
    plain: bool = False,
) -> tuple[KVCaches, DeviceState, Int[Array, "num_rows num_spec_plus_1"], LogprobsTensors | None]:
    """Logits, sampling (or verification of drafts), the post-update, and the next drafts.

    The grammar's bitmask has a row per logits row: ``num_rows * (num_spec + 1)``,
    row ``r * (num_spec + 1) + j`` for request row r's logits after its draft j - 1.
    The logprobs are of the emitted tokens, one row per logits row likewise.
    ``plain``: the batch uses no sampling stage before the draw and asks for no
    logprobs (``sample``'s plain path; without drafts only).
    """
    model = statics.model(param_leaves, state.kv_scales)
    config = statics.sampler_config
    head = jax.tree.map(lambda a: a[:num_rows], rows)
    if statics.num_spec == 0:
        logits = model.compute_logits(sample_hidden[:num_rows, 0])
        output = sample(
            logits,
            state.sampling,
            state.token_ids,
            head.idx_mapping,
            head.positions[:, 0],
            grammar_bitmask,
            grammar_active,
            max_logprobs=config.max_logprobs,
            logprobs_mode=config.logprobs_mode,
            plain=plain,
        )
        tokens = output.sampled_token_ids[:, None]
        state = post_update(state, rows, tokens, jnp.ones(num_rows, jnp.int32))
        return draft_kv, state, tokens, output.logprobs
    assert grammar_bitmask is not None and grammar_active is not None, "verification applies the grammar"
    state, tokens, num_sampled, logprobs = _verify_drafts(
        statics, model, sample_hidden[:num_rows], head, state, grammar_bitmask, grammar_active
    )
    state = post_update(state, rows, tokens, num_sampled)
    if statics.drafter is not None:
        # The target's feature at the last accepted row, for heads that read it.
        features = jnp.take_along_axis(
            sample_hidden[:num_rows], jnp.maximum(num_sampled - 1, 0)[:, None, None], axis=1
        )[:, 0]
        draft_kv, state = _propose_on_device(statics, model, draft_leaves, draft_kv, state, head, features)
    elif statics.ngram is not None:
        state = _propose_ngram(statics.ngram, state, head)
    return draft_kv, state, tokens, logprobs


def _verify_drafts(
    statics: StepStatics,
    model: CausalLM,
    sample_hidden: Float[Array, "num_rows num_spec_plus_1 hidden_size"],
    head: SampleRows,
    state: DeviceState,
    grammar_bitmask: Int[Array, "num_logits_rows bitmask_words"],
    grammar_active: Bool[Array, " num_logits_rows"],
) -> tuple[DeviceState, Int[Array, "num_rows num_spec_plus_1"], Int[Array, " num_rows"], LogprobsTensors]:
    """Rejection sampling of each row's drafts: the state with the drafts in ``token_ids``, the
    emitted tokens (-1 after them), their number, and their logprobs (a row per logits row).

    Every logits row goes through the full pipeline, row j (after draft j - 1) with the
    drafts before it as generated tokens: the bad words' history reads them from
    ``token_ids``, the penalties count them, as one step at a time would.
    """
    num_rows, k1 = sample_hidden.shape[:2]
    config = statics.sampler_config
    flat = lambda a: a.reshape(num_rows * k1, *a.shape[2:])
    repeat = lambda a: jnp.repeat(a, k1, axis=0)
    unflat = lambda a: a.reshape(num_rows, k1, *a.shape[1:])
    num_drafts = num_valid_drafts(head.draft_tokens, head.num_drafts)
    drafts = jnp.where(jnp.arange(k1 - 1)[None, :] < num_drafts[:, None], head.draft_tokens, -1)
    state = _write_drafts(state, head, drafts)
    ahead = jnp.where(jnp.arange(k1 - 1)[None, None, :] < jnp.arange(k1)[None, :, None], drafts[:, None], -1)
    prepared = prepare_logits(
        model.compute_logits(flat(sample_hidden)),
        state.sampling,
        state.token_ids,
        repeat(head.idx_mapping),
        flat(head.positions),
        grammar_bitmask,
        grammar_active,
        flat(ahead),
    )
    verify = jnp.where(prepared.is_greedy[:, None], prepared.processed, prepared.tempered)
    tokens, num_sampled = rejection_sample(
        unflat(verify),
        head.draft_tokens,
        num_drafts,
        None,
        unflat(prepared.is_greedy)[:, 0],
        prepared.rows.seed_lo[::k1],
        prepared.rows.seed_hi[::k1],
        head.positions,
    )
    logprobs = logprobs_of(prepared, flat(jnp.maximum(tokens, 0)), config.max_logprobs, config.logprobs_mode)
    return state, tokens, num_sampled, logprobs


def _write_drafts(state: DeviceState, head: SampleRows, drafts: Int[Array, "num_rows num_spec"]) -> DeviceState:
    """The drafts (-1: none) in ``token_ids`` after each row's first input position, where the
    accepted ones stay; the rejected ones lie past the request's tokens, where nothing reads them."""
    k = drafts.shape[1]
    rows = jnp.where(drafts >= 0, head.idx_mapping[:, None], state.token_ids.shape[0])
    positions = head.positions[:, :1] + 1 + jnp.arange(k)[None, :]
    return dataclasses.replace(state, token_ids=state.token_ids.at[rows, positions].set(drafts, mode="drop"))


def _propose_ngram(ngram: NgramDrafter, state: DeviceState, head: SampleRows) -> DeviceState:
    """Next step's n-gram drafts from each row's history, which ends at its last accepted token
    (the next step's first input, at position ``num_computed_tokens``), left on the device."""
    lengths = state.num_computed_tokens.at[head.idx_mapping].get(mode="fill", fill_value=0) + 1
    drafts = ngram.propose(state.token_ids, head.idx_mapping, lengths)
    return dataclasses.replace(state, draft_tokens=state.draft_tokens.at[head.idx_mapping].set(drafts, mode="drop"))


def decode_steps(
    statics: StepStatics,
    param_leaves: ParamLeaves,
    draft_leaves: ParamLeaves,
    kv_caches: KVCaches,
    draft_kv: KVCaches,
    state: DeviceState,
    step_buffer: Int[Array, " buffer_words"],
    lora_weights: LoRAWeights | None,
    encoder_cache: Float[Array, "encoder_cache_size hidden_size"] | None,
    *,
    shape: StepShape,
    num_rows: int,
    num_steps: int,
) -> tuple[KVCaches, KVCaches, DeviceState, Int[Array, "num_rows num_steps"]]:
    """``num_steps`` decode steps back to back (multi-step scheduling): each a forward step and
    the plain sampling step, each step's sampled tokens the next one's inputs, all on the device.

    Returns the caches, the state and the tokens ``[num_rows, num_steps]``. The steps are
    unrolled, not a device loop: XLA reads a while loop's condition back on the host at
    every iteration (see ``build_step_inputs``), which would hold the calling thread until
    the last step and leave no host work to overlap.
    """
    tokens = []
    for _ in range(num_steps):
        kv_caches, draft_kv, state, sample_hidden, rows, _ = forward(
            statics,
            param_leaves,
            draft_leaves,
            kv_caches,
            draft_kv,
            state,
            step_buffer,
            lora_weights,
            encoder_cache,
            shape=shape,
        )
        draft_kv, state, step_tokens, _ = sample_step(  # the plain path takes no grammar
            statics,
            param_leaves,
            draft_leaves,
            draft_kv,
            sample_hidden,
            rows,
            state,
            None,
            None,
            num_rows=num_rows,
            plain=True,
        )
        tokens.append(step_tokens)
    return kv_caches, draft_kv, state, jnp.concatenate(tokens, axis=1)


def _propose_on_device(
    statics: StepStatics,
    model: CausalLM,
    draft_leaves: ParamLeaves,
    draft_kv: KVCaches,
    state: DeviceState,
    head: SampleRows,
    features: Float[Array, "num_rows hidden_size"],
) -> tuple[KVCaches, DeviceState]:
    """Next step's drafts from each sampling row's new last token, left on the device."""
    assert statics.drafter is not None
    idx = head.idx_mapping
    take = lambda a: a.at[idx].get(mode="fill", fill_value=0)
    drafter = statics.draft_module(draft_leaves, state.draft_kv_scales)
    draft_kv, drafts = statics.drafter.propose(
        drafter,
        draft_kv,
        model,
        state.block_table,
        idx,
        take(state.last_sampled_tokens),
        take(state.num_computed_tokens),
        features,
        head.is_sampling,
        statics.num_spec,
        statics.block_size,
        statics.attention_backend,
    )
    return draft_kv, dataclasses.replace(
        state,
        draft_tokens=state.draft_tokens.at[idx].set(drafts, mode="drop"),
        draft_kv_scales=nnx.state(drafter, KVScale),
    )


def embed_with_encoder_outputs(
    model: CausalLM,
    input_ids: Int[Array, " num_tokens"],
    encoder_cache: Float[Array, "encoder_cache_size hidden_size"],
    encoder_rows: Int[Array, " num_tokens"],
) -> Float[Array, "num_tokens hidden_size"]:
    """The step's input embeddings: each image placeholder's encoder output (its row of the encoder
    cache), every other token's embedding."""
    from_encoder = encoder_cache.at[encoder_rows].get(mode="fill", fill_value=0)
    return jnp.where((encoder_rows >= 0)[:, None], from_encoder, model.embed(input_ids))


def encode_image(
    statics: StepStatics,
    param_leaves: ParamLeaves,
    encoder_cache: Float[Array, "encoder_cache_size hidden_size"],
    patches: Float[Array, "num_patches patch_features"],
    patch_positions: Int[Array, "num_patches 2"],
    frames: Int[Array, " num_patches"],
    windows: Int[Array, " num_patches"],
    cache_rows: Int[Array, " num_merged"],
) -> Float[Array, "encoder_cache_size hidden_size"]:
    """The vision encoder over one image's patches (padded to the bucket: padding is a frame of its own),
    its merged tokens written to ``cache_rows`` of the encoder cache (rows past the cache: dropped)."""
    model = statics.model(param_leaves)
    assert isinstance(model, VisionLanguageLM), "only a vision-language model encodes images"
    embeds = model.embed_vision(patches, patch_positions, frames, windows)
    return encoder_cache.at[cache_rows].set(embeds.astype(encoder_cache.dtype), mode="drop")


def prompt_logprobs(
    statics: StepStatics,
    param_leaves: ParamLeaves,
    hidden: Float[Array, "num_tokens hidden_size"],
    targets: Int[Array, " num_tokens"],
    num_logprobs: Int[Array, " num_tokens"],
) -> LogprobsTensors:
    """Raw logprobs of each next prompt token, in row chunks to bound the logits' memory."""
    model = statics.model(param_leaves)
    chunk = min(hidden.shape[0], 256)
    pad = -hidden.shape[0] % chunk
    split = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, chunk, *a.shape[1:])

    def one_chunk(args):
        h, t, k = args
        return compute_logprobs(model.compute_logits(h), t, k, statics.sampler_config.max_logprobs)

    out = jax.lax.map(one_chunk, (split(hidden), split(targets), split(num_logprobs)))
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[: hidden.shape[0]], out)
