"""Input the runner or engine cannot honour is refused with an error naming the field, before any state changes."""

import math
from typing import Any

import numpy as np
import pytest
from runner_driver import make_runner, tiny_llm

from jaxrunner import LLM, SamplingParams
from jaxrunner.envs import MAX_N_SEQUENCES_ENV_VAR
from jaxrunner.interfaces import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models import init_random_model
from jaxrunner.models.builtin import BUILTIN_MODELS


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("top_k", 1.5, "must be an integer"),
        ("max_tokens", 2.5, "must be an integer"),
        ("n", 2.0, "must be an integer"),
        ("seed", 1.5, "must be an integer"),
        ("logprobs", True, "must be an integer"),
        ("temperature", math.nan, "must be finite"),
        ("top_p", math.inf, "must be finite"),
        ("presence_penalty", math.nan, "must be finite"),
        ("frequency_penalty", -math.inf, "must be finite"),
        ("repetition_penalty", "1.2", "must be a real number"),
    ],
)
def test_sampling_params_refuse_wrong_number_types(field, value, why):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} {why}"):
        _params(**{field: value})


def _params(**fields: Any) -> SamplingParams:
    """SamplingParams from fields of any type: the values a user may pass, not the ones annotated."""
    return SamplingParams(**fields)


@pytest.mark.parametrize("bias, why", [({5: math.nan}, r"logit_bias\[5\] must be finite"), ({5: math.inf}, "finite")])
def test_logit_bias_refuses_non_finite_values(bias, why):
    with pytest.raises(ValueError, match=why):
        _params(logit_bias=bias)
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        _params(logit_bias={1.5: 1.0})


def test_numpy_integers_are_taken_as_python_numbers():
    params = _params(n=np.int64(2), max_tokens=np.int32(7), temperature=np.float32(0.5), logit_bias={np.int64(3): 1})
    assert (params.n, params.max_tokens, params.logit_bias) == (2, 7, {3: 1.0})
    assert type(params.n) is int and type(params.temperature) is float


def test_n_is_bounded_as_vllm_bounds_it(monkeypatch):
    """Each of n completions is a request: n=10**9 would exhaust the host's memory, so n has vLLM's bound."""
    monkeypatch.delenv(MAX_N_SEQUENCES_ENV_VAR, raising=False)
    assert _params(n=16384).n == 16384
    with pytest.raises(
        ValueError, match=rf"SamplingParams\.n must be at most 16384; got {10**9}.*{MAX_N_SEQUENCES_ENV_VAR}"
    ):
        _params(n=10**9)
    monkeypatch.setenv(MAX_N_SEQUENCES_ENV_VAR, "4")
    assert _params(n=4).n == 4
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be at most 4; got 5"):
        _params(n=5)


def test_best_of_is_refused_as_vllm_v1_refuses_it():
    with pytest.raises(TypeError, match="best_of"):
        _params(best_of=2)


def _new(req_id: str, **fields) -> NewRequestData:
    block_ids = fields.pop("block_ids", ([1],))
    return NewRequestData(req_id, [1, 2, 3], SamplingParams(temperature=0.0), block_ids, 0, **fields)


def _step(*new_reqs: NewRequestData) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r.req_id: 3 for r in new_reqs},
        total_num_scheduled_tokens=3 * len(new_reqs),
    )


@pytest.mark.parametrize(
    "fields, missing",
    [
        ({"lora_request": object()}, "has a lora_request, but LoRA is off"),
        ({"mm_features": [object()]}, "a text model with no encoder"),
        ({"block_ids": ([1], [2])}, "2 KV-cache groups"),
    ],
)
def test_runner_refuses_what_it_cannot_do_yet_and_keeps_its_state(fields, missing):
    runner = make_runner(init_random_model(BUILTIN_MODELS["tiny-llama"], dtype="float32"), num_blocks=16)
    with pytest.raises(NotImplementedError, match=missing):
        runner.execute_model(_step(_new("plain"), _new("unsupported", **fields)))
    assert runner.req_states.req_id_to_index == {}  # neither request was added
    assert runner.execute_model(_step(_new("plain"))) is None  # the next step runs
    output = runner.sample_tokens()
    assert isinstance(output, ModelRunnerOutput) and output.req_ids == ["plain"]


def test_llm_without_lora_refuses_a_lora_request_before_adding_any_prompt(cache_dir):
    llm = tiny_llm(cache_dir, max_model_len=64, max_num_seqs=2, request_buckets=[2])
    with pytest.raises(ValueError, match="LoRA is off in this LLM: make it with LLM\\(..., enable_lora=True\\)"):
        llm.generate(["a", "b"], lora_request=[None, LoRARequest("sql", 1, "/adapters/sql")], use_tqdm=False)
    assert not llm.replicas.has_unfinished_requests()


def test_max_model_len_beyond_the_models_positions_needs_the_users_word(monkeypatch, cache_dir):
    from jaxrunner.envs import ALLOW_LONG_MAX_MODEL_LEN_ENV_VAR

    positions = BUILTIN_MODELS["tiny-llama"].max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len {positions + 1} is more than the model's {positions}"):
        LLM("tiny-llama", max_model_len=positions + 1, max_num_seqs=2)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV_VAR, "1")
    llm = tiny_llm(cache_dir, max_model_len=positions + 1, max_num_seqs=2, request_buckets=[2])
    assert llm.llm_engine.max_model_len == positions + 1


@pytest.mark.parametrize("limit", ["max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_zero_or_negative_limits_are_refused_not_replaced(limit, value):
    with pytest.raises(ValueError, match=rf"SchedulerConfig\.{limit} must be positive; got {value}"):
        LLM("tiny-llama", max_model_len=64, **{limit: value})
