"""Penalties and logprobs modes end to end: every step's logits adjustment recomputed in NumPy.

The built-in tiny model's vocabulary is small enough to ask for logprobs over all
of it, so ``raw_logits`` returns each step's whole logits row and
``processed_logits`` the whole row the sampler drew from. The oracle rebuilds the
latter from the former and the generated history: repetition over prompt and
output tokens, frequency and presence over output counts, then temperature.
"""

import numpy as np
import pytest
from runner_driver import tiny_llm

from jaxrunner.interfaces import SamplingParams
from jaxrunner.models.builtin import BUILTIN_MODELS

VOCAB = BUILTIN_MODELS["tiny-llama"].vocab_size
PROMPTS = [[7, 8, 9, 7, 8, 9, 10, 11], [40, 41, 42, 43, 40, 41]]
PARAMS = [
    # Seeded random sampling: processed logits are the penalized logits over the temperature.
    SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.7,
        frequency_penalty=0.6,
        presence_penalty=0.9,
        logprobs=VOCAB,
    ),
    # Greedy: the penalties alone, and they must keep it from repeating its favourite token.
    SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=0.6,
        frequency_penalty=1.3,
        presence_penalty=-0.4,
        logprobs=VOCAB,
    ),
]


def run(cache_dir, mode: str) -> list:
    """Each prompt's completion under ``mode``, all logprobs asked for."""
    llm = tiny_llm(cache_dir, logprobs_mode=mode, max_logprobs=VOCAB)
    return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def full_rows(completion) -> np.ndarray:
    """``[num_tokens, vocab]``: each step's values over the whole vocabulary, from its logprobs dicts."""
    rows = np.full((len(completion.token_ids), VOCAB), np.nan)
    for i, entry in enumerate(completion.logprobs):
        for token, logprob in entry.items():
            rows[i, token] = logprob.logprob
    assert not np.isnan(rows).any(), "every token's value is returned"
    return rows


def penalized(raw: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams) -> np.ndarray:
    """vLLM's penalties on one logits row, given the tokens generated before it."""
    counts = np.bincount(np.asarray(output, np.int64), minlength=VOCAB)[:VOCAB]
    seen = counts > 0
    seen[prompt] = True
    r = params.repetition_penalty
    logits = np.where(seen, np.where(raw > 0, raw / r, raw * r), raw)
    logits = logits - params.frequency_penalty * counts
    return logits - params.presence_penalty * (counts > 0)


@pytest.fixture(scope="module")
def runs(cache_dir):
    return {mode: run(cache_dir, mode) for mode in ("raw_logits", "processed_logits", "raw_logprobs")}


def test_processed_logits_equal_the_penalties_recomputed_from_the_history(runs):
    """Every step: processed = penalties(raw, prompt, outputs so far) / temperature, to 1e-4."""
    for prompt, params, raw_out, processed_out in zip(PROMPTS, PARAMS, runs["raw_logits"], runs["processed_logits"]):
        assert raw_out.token_ids == processed_out.token_ids  # the mode changes what is reported, not the draw
        raw, processed = full_rows(raw_out), full_rows(processed_out)
        temperature = params.temperature if params.temperature > 0 else 1.0
        for i in range(len(raw_out.token_ids)):
            expected = penalized(raw[i], prompt, raw_out.token_ids[:i], params) / temperature
            np.testing.assert_allclose(processed[i], expected, rtol=1e-5, atol=1e-4, err_msg=f"step {i}")
        if params.temperature == 0:  # greedy takes the argmax of the processed row
            assert raw_out.token_ids == [int(np.argmax(row)) for row in processed]


def test_the_penalties_change_the_draw(runs):
    """The oracle compares rows that differ from the raw ones: the penalties acted at every step after the first."""
    for out_raw, out_processed in zip(runs["raw_logits"], runs["processed_logits"]):
        raw, processed = full_rows(out_raw), full_rows(out_processed)
        assert all(not np.allclose(r, p) for r, p in zip(raw[1:], processed[1:]))


def test_raw_logprobs_are_the_log_softmax_of_raw_logits(runs):
    for raw_out, logprobs_out in zip(runs["raw_logits"], runs["raw_logprobs"]):
        assert raw_out.token_ids == logprobs_out.token_ids
        raw = full_rows(raw_out)
        expected = (
            raw
            - np.log(np.sum(np.exp(raw - raw.max(-1, keepdims=True)), -1, keepdims=True))
            - raw.max(-1, keepdims=True)
        )
        np.testing.assert_allclose(full_rows(logprobs_out), expected, atol=1e-4)
        # The chosen token's rank counts the tokens scoring at least as high.
        for i, (token, entry) in enumerate(zip(raw_out.token_ids, raw_out.logprobs)):
            assert entry[token].rank == int(np.sum(raw[i] >= raw[i][token]))
