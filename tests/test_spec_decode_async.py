"""Speculative decoding under async scheduling: drafts and accepted counts stay on the device.

Step k+1 is dispatched before step k's tokens are read (the plain path's test
asserts it the same way), so its inputs (the last accepted token, the number
of computed tokens, the drafts) come from the device; the host catches up when
it reads the tokens. Greedy tokens, and their logprobs, must equal those without speculation.
"""

import numpy as np
import pytest
from runner_driver import tiny_llm
from test_engine import _dispatch_order
from test_spec_decode import assert_same_logprobs

from jaxrunner.interfaces import SamplingParams

NUM_SPEC = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)
# Penalties count the drafts ahead of each verified row as generated, as one step at a time would.
PENALIZED = SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2
)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 259, 7).tolist()
    repetitive = [phrase * 4, (phrase[:3] * 6)[:17], phrase * 2 + [5, 6]]
    return repetitive + [rng.integers(3, 259, n).tolist() for n in (5, 40, 11, 23)]


# The longest prompt (40) and max_tokens (24) fill it: a host that lost count of rejected drafts
# would see requests past it.
MAX_MODEL_LEN = 64


def spec(method: str, **extra) -> dict:
    return {"method": method, "num_speculative_tokens": NUM_SPEC, **extra}


def completions(llm, params):
    return [o.outputs[0] for o in llm.generate(prompts(), params, use_tqdm=False)]


def token_ids(llm, params) -> list[list[int]]:
    return [c.token_ids for c in completions(llm, params)]


@pytest.fixture(scope="module")
def expected(cache_dir) -> tuple[list, list[list[int]]]:
    """Without speculation, one step at a time: greedy completions with logprobs, penalized greedy tokens."""
    llm = tiny_llm(cache_dir, async_scheduling=False, max_model_len=MAX_MODEL_LEN)
    return completions(llm, GREEDY), token_ids(llm, PENALIZED)


@pytest.mark.parametrize(
    "config, overrides",
    [
        (spec("ngram_gpu"), {}),
        # The draft has the target's weights: every draft is accepted. A cache of 12 blocks
        # for 4 requests of up to 60 tokens with 3 lookahead slots each forces preemptions.
        (spec("draft_model", model="tiny-llama"), {"num_gpu_blocks_override": 12}),
    ],
    ids=["ngram_gpu", "draft_model"],
)
def test_speculative_steps_overlap_and_change_no_token(cache_dir, expected, monkeypatch, config, overrides):
    llm = tiny_llm(cache_dir, speculative_config=config, max_model_len=MAX_MODEL_LEN, **overrides)
    assert llm.llm_engine.runner.use_async_scheduling
    events = _dispatch_order(llm, monkeypatch)
    for got, want in zip(completions(llm, GREEDY), expected[0]):
        assert_same_logprobs(got, want)
    assert "DDR" in "".join(events)  # a step dispatched before the one before it was read
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted > 0
    if config["method"] == "draft_model":  # greedy drafts of the target's own weights
        assert stats.num_accepted == stats.num_drafts
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert token_ids(llm, PENALIZED) == expected[1]
    manager = llm.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_device_ngram_samples_what_the_host_ngram_samples(cache_dir):
    """One step at a time, "ngram_gpu" verifies the host proposer's very drafts: seeded
    sampling, and greedy rows with penalties (which count the drafts ahead of a row), give
    the same tokens."""
    params = [
        SamplingParams(
            temperature=0.9 * (1 - i % 2), seed=i, max_tokens=20, ignore_eos=True, presence_penalty=0.2 * (i % 3 == 2)
        )
        for i in range(len(prompts()))
    ]
    host = tiny_llm(cache_dir, speculative_config=spec("ngram"))
    assert not host.llm_engine.runner.use_async_scheduling  # vLLM's rule: host n-gram drafts, one step at a time
    device = tiny_llm(cache_dir, async_scheduling=False, speculative_config=spec("ngram_gpu"))
    assert token_ids(device, params) == token_ids(host, params)
    host_stats, device_stats = host.llm_engine.scheduler.spec_stats, device.llm_engine.scheduler.spec_stats
    assert device_stats.num_accepted == host_stats.num_accepted > 0
