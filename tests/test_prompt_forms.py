"""vLLM's prompt forms through ``LLM``: dicts, NumPy token ids, ``skip_tokenizer_init``, bad forms refused."""

from typing import Any

import numpy as np
import pytest
from hf_models import save_tiny_hf_model
from runner_driver import tiny_llm

import jaxrunner
import jaxrunner.inputs
from jaxrunner import SamplingParams
from jaxrunner.engine.llm import LLM
from jaxrunner.models.tokenizer import BOS_ID, BYTE_OFFSET, BYTE_VOCAB_SIZE, build_byte_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TEXT = "Hello world"
IDS = [BOS_ID] + [BYTE_OFFSET + b for b in TEXT.encode()]  # the byte tokenizer's encoding of TEXT


@pytest.fixture(scope="module")
def llm(cache_dir):
    return tiny_llm(cache_dir)


def tokens_of(llm: LLM, prompts: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_byte_tokenizer_encodes_the_text_as_the_ids():
    assert build_byte_tokenizer().encode(TEXT) == IDS


def test_vllm_prompt_dicts_and_numpy_ids_run_as_their_plain_forms(llm):
    assert jaxrunner.TokensPrompt is jaxrunner.inputs.TokensPrompt
    assert jaxrunner.TextPrompt is jaxrunner.inputs.TextPrompt
    expected = tokens_of(llm, [IDS])[0]
    forms = [
        TEXT,
        jaxrunner.TextPrompt(prompt=TEXT),
        jaxrunner.TokensPrompt(prompt_token_ids=IDS),
        {"prompt_token_ids": np.array(IDS, np.int32)},
        np.array(IDS, np.int64),
        [np.int64(t) for t in IDS],
        tuple(np.uint16(t) for t in IDS),
    ]
    assert tokens_of(llm, forms) == [expected] * len(forms)
    assert tokens_of(llm, np.array([IDS, IDS])) == [expected] * 2  # a 2-D array: one prompt per row
    assert tokens_of(llm, {"prompt": TEXT}) == [expected]  # one dict is one prompt
    assert tokens_of(llm, np.array(IDS)) == [expected]  # one 1-D array is one prompt
    [output] = llm.generate({"prompt_token_ids": IDS, "prompt": "shown"}, GREEDY, use_tqdm=False)
    assert output.prompt == "shown" and output.prompt_token_ids == IDS
    for numpy_ids in (np.array(IDS), [np.int32(t) for t in IDS]):  # NumPy integers become Python ints
        [output] = llm.generate([numpy_ids], GREEDY, use_tqdm=False)
        assert [type(t) for t in output.prompt_token_ids] == [int] * len(IDS)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (np.array([5.0, 6.0]), TypeError, r"prompts\[1\] is a NumPy array of float64 with shape \(2,\)"),
        (np.array([True, False]), TypeError, r"prompts\[1\] is a NumPy array of bool"),
        ([5, 6.0], TypeError, r"prompts\[1\]\[1\] is 6.0 \(float\); token ids must be integers"),
        ([5, True], TypeError, r"prompts\[1\]\[1\] is True \(bool\)"),
        ({"prompt_token_ids": "abc"}, TypeError, r"prompts\[1\]\['prompt_token_ids'\] must be token ids"),
        ({"prompt": 5}, TypeError, r"prompts\[1\]\['prompt'\] must be text"),
        ({"text": TEXT}, ValueError, r"prompts\[1\] has keys \['text'\] that are not supported"),
        ({}, ValueError, r"prompts\[1\] is a dict without 'prompt' or 'prompt_token_ids'"),
        (7.5, TypeError, r"prompts\[1\] must be text, token ids or a dict .* got float"),
    ],
)
def test_a_prompt_of_a_wrong_form_is_refused_naming_it(llm, bad, error, match):
    with pytest.raises(error, match=match):
        llm.generate([IDS, bad], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_token_ids_outside_the_vocabulary_get_an_error_output(llm):
    vocab = llm.llm_engine.runner.vocab_size
    outputs = llm.generate([[1, vocab], IDS, [-1, 5]], GREEDY, use_tqdm=False)
    assert [o.error is not None for o in outputs] == [True, False, True]
    for bad, output in ((vocab, outputs[0]), (-1, outputs[2])):
        assert output.error is not None
        assert f"[{bad}] are outside the model's vocabulary: ids must be in [0, {vocab})" in output.error
        assert output.outputs[0].finish_reason == "error"
    assert len(outputs[1].outputs[0].token_ids) == GREEDY.max_tokens


def test_skip_tokenizer_init_runs_token_ids_and_refuses_text(llm, cache_dir):
    bare = tiny_llm(cache_dir, skip_tokenizer_init=True)
    assert bare.tokenizer is None
    [output] = bare.generate([{"prompt_token_ids": IDS}], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == tokens_of(llm, [IDS])[0]
    assert output.outputs[0].text == "" and output.prompt is None
    with pytest.raises(ValueError, match=r"prompts\[1\] is text, .* pass token ids .* or drop skip_tokenizer_init"):
        bare.generate([IDS, TEXT], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        bare.get_tokenizer()
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert not bare.llm_engine.has_unfinished_requests()


def test_a_checkpoint_without_tokenizer_files_runs_with_skip_tokenizer_init(tmp_path, cache_dir):
    save_tiny_hf_model("llama", tmp_path, vocab_size=BYTE_VOCAB_SIZE)
    small: dict[str, Any] = dict(
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=64,
        num_gpu_blocks_override=16,
        token_buckets=[16],
        request_buckets=[2],
        compilation_cache_dir=cache_dir,
    )
    with pytest.raises(FileNotFoundError, match=r"no usable tokenizer files .* pass skip_tokenizer_init=True"):
        LLM(str(tmp_path), **small)
    bare = LLM(str(tmp_path), skip_tokenizer_init=True, **small)
    [output] = bare.generate(np.array(IDS), GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens and output.outputs[0].text == ""
