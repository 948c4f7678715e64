"""The full sampler end to end: logprobs vs transformers, seeds, distributions, constraints."""

import dataclasses
import functools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_models import save_tiny_hf_model
from scipy import stats
from test_structured_outputs import SCHEMA

from jaxrunner.config import SamplerConfig
from jaxrunner.engine.llm import LLM
from jaxrunner.engine.structured_outputs import StructuredOutputsParams
from jaxrunner.interfaces import NewRequestData, SamplingParams
from jaxrunner.models.tokenizer import build_byte_tokenizer
from jaxrunner.runner.states import DeviceState, RequestState, write_new_requests
from jaxrunner.sample.sampler import sample, stage_rows
from jaxrunner.sample.sampling_state import SamplingArrays, pack_sampling_params, uses_sampling_stages


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("llama", path, seed=5, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    return path


def test_logprobs_and_prompt_logprobs_match_transformers(hf_dir, cache_dir):
    """Chunked prefill (16-token budget) across a 45-token prompt; float32, 1e-4."""
    llm = LLM(
        str(hf_dir),
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=32,
        token_buckets=[4, 16],
        request_buckets=[2],
        compilation_cache_dir=cache_dir,
    )
    prompt = np.random.default_rng(0).integers(3, 259, 45).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    assert completion.logprobs is not None and completion.cumulative_logprob is not None  # logprobs=5 asked
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token]) < 1e-4
        assert entry[token].rank == int(np.sum(row >= row[token]))
        top = np.argsort(-row)[:5]
        assert set(entry) >= set(top.tolist())
        np.testing.assert_allclose([entry[t].logprob for t in top], row[top], atol=1e-4)
    assert (
        abs(
            completion.cumulative_logprob - sum(ref[len(prompt) - 1 + i][t] for i, t in enumerate(completion.token_ids))
        )
        < 1e-3
    )
    assert out.prompt_logprobs is not None  # prompt_logprobs=3 asked
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[p], ref[p - 1]
        assert entry is not None  # only the first prompt token has none
        assert abs(entry[prompt[p]].logprob - row[prompt[p]]) < 1e-4
        assert len(entry) <= 4 and set(np.argsort(-row)[:3].tolist()) <= set(entry)


def test_processed_logprobs_follow_temperature_and_top_k(hf_dir, cache_dir):
    """processed_logprobs: the distribution sampled from (after temperature and top-k)."""
    llm = LLM(
        str(hf_dir),
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=32,
        token_buckets=[4, 16],
        request_buckets=[2],
        compilation_cache_dir=cache_dir,
        logprobs_mode="processed_logprobs",
    )
    prompt = np.random.default_rng(2).integers(3, 259, 12).tolist()
    params = SamplingParams(temperature=0.5, top_k=10, seed=4, max_tokens=4, logprobs=3, ignore_eos=True)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0].double().numpy()
    assert completion.logprobs is not None  # logprobs=3 asked
    for i, token in enumerate(completion.token_ids):
        z = logits[len(prompt) - 1 + i] / 0.5
        z = np.where(z >= np.sort(z)[-10], z, -np.inf)
        expected = z[token] - np.log(np.sum(np.exp(z[np.isfinite(z)] - z.max()))) - z.max()
        assert abs(completion.logprobs[i][token].logprob - expected) < 1e-4


def test_seeded_request_is_the_same_alone_in_a_batch_of_64_and_at_another_bucket(cache_dir):
    llm = LLM(
        "tiny-llama",
        max_num_seqs=72,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=400,
        token_buckets=[8, 128],
        request_buckets=[1, 8, 72],
        compilation_cache_dir=cache_dir,
    )
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 259, 9).tolist()
    seeded = SamplingParams(
        temperature=0.9,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        seed=77,
        max_tokens=16,
        ignore_eos=True,
    )
    others = lambda n: [rng.integers(3, 259, rng.integers(1, 12)).tolist() for _ in range(n)]
    other_params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def seeded_tokens(num_others: int) -> list[int]:
        prompts = others(num_others) + [prompt]
        params = [other_params] * num_others + [seeded]
        return llm.generate(prompts, params, use_tqdm=False)[-1].outputs[0].token_ids

    alone = seeded_tokens(0)
    assert len(set(alone)) > 3
    assert seeded_tokens(63) == alone
    assert seeded_tokens(5) == alone


def _batch_sampling(n: int, vocab: int, **values) -> SamplingArrays:
    """A SamplingArrays of n rows with neutral defaults and ``values`` broadcast per row."""
    state = SamplingArrays.zeros(n, SamplerConfig(), vocab)
    updates = {
        k: jnp.broadcast_to(jnp.asarray(v, getattr(state, k).dtype), getattr(state, k).shape) for k, v in values.items()
    }
    return SamplingArrays(**{**state.__dict__, **updates})


def _frequencies(logits: np.ndarray, num_samples: int, **values) -> np.ndarray:
    vocab = logits.shape[0]
    seeds = np.arange(num_samples, dtype=np.uint32)
    state = _batch_sampling(num_samples, vocab, seed_lo=seeds, seed_hi=seeds * 7 + 1, **values)
    idx = jnp.arange(num_samples, dtype=jnp.int32)
    run = jax.jit(
        lambda lg, s: (
            sample(
                lg,
                s,
                jnp.zeros((num_samples, 4), jnp.int32),
                idx,
                jnp.full(num_samples, 3, jnp.int32),
                jnp.zeros((num_samples, -(-vocab // 32)), jnp.int32),
                jnp.zeros(num_samples, bool),
                max_logprobs=2,
                logprobs_mode="raw_logprobs",
            ).sampled_token_ids
        )
    )
    tokens = np.asarray(run(jnp.broadcast_to(jnp.asarray(logits), (num_samples, vocab)), state))
    return np.bincount(tokens, minlength=vocab)


def _target(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    z = logits.astype(np.float64) / temperature
    keep = np.ones_like(z, bool)
    if min_p:
        keep &= z >= z.max() + np.log(min_p)
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        cut = np.zeros_like(keep)
        cut[order[before < top_p]] = True
        p = np.where(cut, p, 0)
        p /= p.sum()
    return p


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=12),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.05, top_k=20, top_p=0.9),
    ],
)
def test_sampled_frequencies_match_the_filtered_softmax(settings):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.5, 40).astype(np.float32)
    counts = _frequencies(logits, 40_000, **settings)
    assert _chi_square_pvalue(counts, _target(logits, **settings)) > 1e-3
    # The test can tell a wrong distribution: the same counts against T off by 20%.
    wrong = dict(settings, temperature=settings["temperature"] * 1.2)
    assert _chi_square_pvalue(counts, _target(logits, **wrong)) < 1e-6


def test_plain_path_draws_what_the_full_path_draws():
    """Greedy and seeded random rows: the conditional-free path gives the full path's tokens."""
    n, vocab = 6, 50
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 2.0, (n, vocab)), jnp.bfloat16)
    seeds = np.arange(n, dtype=np.uint32) * 11 + 3
    state = _batch_sampling(n, vocab, temperature=[0.0, 0.7, 1.3, 0.0, 1.0, 2.5], seed_lo=seeds, seed_hi=seeds + 1)
    idx, positions = jnp.arange(n, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32) + 5
    run = lambda plain: sample(
        logits,
        state,
        jnp.zeros((n, 4), jnp.int32),
        idx,
        positions,
        jnp.zeros((n, 2), jnp.int32),
        jnp.zeros(n, bool),
        max_logprobs=2,
        logprobs_mode="raw_logprobs",
        plain=plain,
    )
    full, plain = run(False), run(True)
    np.testing.assert_array_equal(plain.sampled_token_ids, full.sampled_token_ids)
    greedy = np.asarray(jnp.argmax(logits.astype(jnp.float32), axis=-1))
    assert np.asarray(plain.sampled_token_ids)[[0, 3]].tolist() == greedy[[0, 3]].tolist()
    assert not np.array_equal(np.asarray(plain.sampled_token_ids), greedy)  # the random rows drew noise
    assert not np.asarray(plain.logprobs.token_ids).any()


@pytest.mark.parametrize(
    "params, uses",
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.8, seed=1), False),
        (SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1), False),  # ignored by greedy rows
        (SamplingParams(temperature=0.8, top_p=0.9), True),
        (SamplingParams(temperature=0.8, top_k=5), True),
        (SamplingParams(temperature=0.8, min_p=0.1), True),
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), True),
        (SamplingParams(temperature=0.0, frequency_penalty=0.2), True),
        (SamplingParams(temperature=0.0, presence_penalty=0.2), True),
        (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), True),
        (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]), True),
        (SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5]]), True),
        (SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]), True),
    ],
)
def test_which_parameters_use_sampling_stages(params, uses):
    """The host's reading of the parameters, and the device's stage predicates on the row it writes."""
    config, vocab, prompt = SamplerConfig(), 64, [1, 2, 3]
    assert uses_sampling_stages(pack_sampling_params(params, random.Random(0), config, vocab)) is uses
    req_states = RequestState(2, 32, 2, 0, config, vocab)
    slot = req_states.add_request(NewRequestData("r", prompt, params, ([0],), 0, prefill_token_ids=prompt))
    assert req_states.plain_sampling[slot] == (not uses)
    staged = req_states.take_staged_rows(1)
    assert staged is not None  # the request added above
    state = write_new_requests(DeviceState.zeros(2, 32, 2, config, vocab), jnp.asarray(staged), req_states.layout)
    row = jax.tree.map(lambda a: a[slot : slot + 1], state.sampling)
    # The decode row that predicts the first output token.
    acting = stage_rows(row, jnp.array([len(prompt) - 1]))
    assert any(bool(rows[0]) for rows in acting.values()) is uses, acting


def test_engine_takes_the_plain_path_and_samples_as_the_full_path(cache_dir, monkeypatch):
    """The same seeded requests with logprobs (the full path) and without (the plain path)."""
    llm = LLM(
        "tiny-llama",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=100,
        token_buckets=[4, 64],
        request_buckets=[4],
        compilation_cache_dir=cache_dir,
    )
    runner = llm.llm_engine.runner
    programs = runner.compilation.sample
    paths = []
    get = programs.get

    def recording_get(key: tuple[int, bool]) -> jax.stages.Compiled:
        paths.append(key[1])
        return get(key)

    monkeypatch.setattr(programs, "get", recording_get)
    prompts = [[3, 9, 27, 81], [5, 25, 125], [7, 49]]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
        for t, s in [(0.0, None), (0.9, 21), (1.4, 5)]
    ]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert set(paths) == {True}
    paths.clear()
    with_logprobs = [dataclasses.replace(p, logprobs=1) for p in params]
    full = [o.outputs[0].token_ids for o in llm.generate(prompts, with_logprobs, use_tqdm=False)]
    assert set(paths) == {False}
    assert plain == full and len(set(plain[1])) > 3
    # What the plain path is for: no conditional, which on a GPU would wait for the device.
    plain_text, full_text = programs.get((4, True)).as_text(), programs.get((4, False)).as_text()
    assert plain_text is not None and full_text is not None
    assert " conditional(" not in plain_text
    assert " conditional(" in full_text


def test_constraints_through_the_engine(cache_dir):
    llm = LLM(
        "tiny-llama",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=200,
        token_buckets=[8, 32, 64],
        request_buckets=[2, 8],
        compilation_cache_dir=cache_dir,
    )
    tok = llm.get_tokenizer()
    prompt = "Sampling constraints"
    base = functools.partial(SamplingParams, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    allowed = [tok.encode(c, add_special_tokens=False)[0] for c in "abc"]
    outs = llm.generate(
        [prompt] * 4,
        [
            base(allowed_token_ids=allowed),
            base(logit_bias={allowed[0]: 100.0}),
            base(
                bad_words=["a", "b", "e"],
                allowed_token_ids=allowed + [tok.encode("e", add_special_tokens=False)[0]],
            ),
            SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10, stop_token_ids=allowed, seed=1),
        ],
        use_tqdm=False,
    )
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert outs[1].outputs[0].token_ids == [allowed[0]] * 24
    assert set(outs[2].outputs[0].text) == {"c"}
    assert len(outs[3].outputs[0].token_ids) >= 10


def test_json_schema_generations_parse_and_validate(cache_dir):
    llm = LLM(
        "tiny-llama",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=400,
        token_buckets=[8, 32, 64],
        request_buckets=[2, 8],
        compilation_cache_dir=cache_dir,
    )
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=constraint) for s in range(20)]
    outputs = llm.generate(["Give JSON:"] * 20, params, use_tqdm=False)
    for output in outputs:
        value = json.loads(output.outputs[0].text)
        assert set(value) == {"color", "size", "ok"}
        assert value["color"] in ("red", "green", "blue") and 0 <= value["size"] <= 999
        assert isinstance(value["ok"], bool)
    assert len({o.outputs[0].text for o in outputs}) > 1
