"""Structured outputs without a model: random walks through the grammar bitmasks.

Each generation repeatedly fills the bitmask, picks a random allowed token
(seeded), and accepts it, until the grammar is done or EOS is the only choice;
the text must then parse and match its constraint. Two tokenizers: the byte
tokenizer (one token per byte) and a GPT-2 style byte-level BPE trained here on
JSON-like text, so that tokens span several characters (no download).
With speculative decoding, the drafts' bitmask rows, and the engine's outputs
with n-gram and draft-model drafts.
"""

import json
import math
import random
import re

import numpy as np
import pytest
import transformers
from runner_driver import tiny_llm
from test_spec_decode import assert_same_logprobs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxrunner.engine.structured_outputs import StructuredOutputManager, StructuredOutputsParams
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models.tokenizer import BYTE_VOCAB_SIZE, EOS_ID, build_byte_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
TEAM = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 8},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 99}, "maxItems": 4},
        "people": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2},
    },
    "required": ["team", "scores", "people"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 3}
REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no)!?", r"(ab)+c?"]


def _gpt2_style_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on JSON-like text, with <|endoftext|> as EOS."""
    rng = random.Random(0)
    corpus = [
        json.dumps({"name": rng.choice(["ann", "bob", "carl"]), "age": rng.randint(0, 99), "color": "red"})
        for _ in range(300)
    ] + ["yes no abc 123-4567 x@y.com"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_manager() -> StructuredOutputManager:
    # The model's vocabulary is wider than the tokenizer's, as a padded embedding would be.
    return StructuredOutputManager(build_byte_tokenizer(), vocab_size=320)


@pytest.fixture(scope="module", params=["byte", "bpe"])
def manager(request) -> StructuredOutputManager:
    tokenizer = build_byte_tokenizer() if request.param == "byte" else _gpt2_style_tokenizer()
    return StructuredOutputManager(tokenizer, vocab_size=len(tokenizer) + 40)


def _allowed(row: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row allows (bit v % 32 of word v // 32)."""
    bits = (row[:, None].astype(np.int64) >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1))


def _generate(manager: StructuredOutputManager, params: StructuredOutputsParams, seed: int) -> str:
    """A random walk through the constraint's bitmasks; the text it spells."""
    rng = np.random.default_rng(seed)
    req_id = f"gen-{seed}"
    manager.add_request(req_id, params)
    tokens: list[int] = []
    for _ in range(4000):
        if manager.is_terminated(req_id):
            break
        allowed = _allowed(manager.fill_bitmask([req_id])[0])
        assert allowed.size and allowed.max() < len(manager.tokenizer)
        if allowed.tolist() == [manager.eos_token_id]:
            break
        token = int(rng.choice(allowed))
        assert manager.accept_tokens(req_id, [token])
        if token == manager.eos_token_id:
            break
        tokens.append(token)
    else:
        pytest.fail(f"generation {seed} did not finish")
    manager.remove_request(req_id)
    text = manager.tokenizer.decode(tokens)
    assert isinstance(text, str)  # one sequence of ids decodes to one string
    return text


def _conforms(value, schema: dict) -> bool:
    """Whether ``value`` matches ``schema`` (the keywords these tests use)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(key in value for key in schema.get("required", []))
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(_conforms(v, props[k]) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf)
            and all(_conforms(item, schema["items"]) for item in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", math.inf)
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf)
        )
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"unhandled schema type {kind}")


# --------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": PERSON, "regex": "a"}, {"regex": "a", "choice": ["a"]}],
    ids=["none", "json+regex", "regex+choice"],
)
def test_params_need_exactly_one_constraint(kwargs):
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"choice": []}, {"choice": ["a", 1]}, {"regex": 5}, {"json": 3}])
def test_params_check_types(kwargs):
    with pytest.raises(ValueError, match="must be"):
        StructuredOutputsParams(**kwargs)


# ----------------------------------------------------------------- generation


@pytest.mark.parametrize("compact", [False, True], ids=["any-whitespace", "compact"])
def test_json_schema_generations_validate(manager, compact):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=compact)
    for seed in range(20):
        text = _generate(manager, params, seed)
        assert _conforms(json.loads(text), PERSON), text
        if compact:
            outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
            assert not re.search(r"\s", outside_strings), text


@pytest.mark.parametrize("schema", [TEAM, TAGS], ids=["nested", "array"])
def test_nested_and_array_schemas(manager, schema):
    params = StructuredOutputsParams(json=json.dumps(schema))  # the schema as JSON text
    for seed in range(5):
        text = _generate(manager, params, seed)
        assert _conforms(json.loads(text), schema), text


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_generations_fullmatch(manager, regex):
    params = StructuredOutputsParams(regex=regex)
    for seed in range(5):
        text = _generate(manager, params, seed)
        assert re.fullmatch(regex, text), text


def test_choice_and_grammar(manager):
    choices = ["red", "green", "héllo", "日本"]
    outputs = {_generate(manager, StructuredOutputsParams(choice=choices), seed) for seed in range(12)}
    assert outputs <= set(choices) and len(outputs) > 1
    grammar = 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'  # GBNF; Lark works too
    for seed in range(5):
        text = _generate(manager, StructuredOutputsParams(grammar=grammar), seed)
        assert re.fullmatch(r"\(\d+(,\d+)*\)", text), text


def test_bpe_masks_allow_multi_character_tokens():
    tokenizer = _gpt2_style_tokenizer()
    manager = StructuredOutputManager(tokenizer, vocab_size=len(tokenizer))
    manager.add_request("r", StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    allowed = _allowed(manager.fill_bitmask(["r"])[0])
    assert tokenizer.convert_tokens_to_ids('{"') in allowed  # a merged token, not only '{'


# ------------------------------------------------------------- manager edges


@pytest.mark.parametrize(
    "params, message",
    [
        (StructuredOutputsParams(json={"type": "foo"}), "Invalid structured output json"),
        (StructuredOutputsParams(json={"type": "object", "required": 5}), "Invalid structured output json"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="(?=a)b"), "Invalid structured output regex"),
        (StructuredOutputsParams(regex="a("), "Invalid structured output regex"),
        (StructuredOutputsParams(grammar='start: "a" ('), "Invalid structured output grammar"),
    ],
)
def test_invalid_constraint_raises_value_error(byte_manager, params, message):
    with pytest.raises(ValueError, match=message):
        byte_manager.add_request("bad", params)
    assert not byte_manager.has("bad")


def test_not_params_raises_value_error(byte_manager):
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        byte_manager.add_request("bad", {"json": PERSON})


def test_bitmask_shape_and_ids_past_the_tokenizer(byte_manager):
    byte_manager.add_request("any", StructuredOutputsParams(regex=r"(.|\n)*"))
    bitmask = byte_manager.fill_bitmask(["any"])
    assert bitmask.dtype == np.int32 and bitmask.shape == (1, 10)  # ceil(320 / 32)
    allowed = _allowed(bitmask[0])
    assert allowed.max() < BYTE_VOCAB_SIZE and EOS_ID in allowed
    assert byte_manager.fill_bitmask([]).shape == (0, 10)
    byte_manager.remove_request("any")


def test_model_vocab_smaller_than_tokenizer():
    tokenizer = build_byte_tokenizer()
    manager = StructuredOutputManager(tokenizer, vocab_size=102)  # cuts the bytes past "b" (id 101)
    manager.add_request("r", StructuredOutputsParams(regex="[0-9a-z]*"))
    bitmask = manager.fill_bitmask(["r"])
    assert bitmask.shape == (1, 4)
    expected = [EOS_ID, *tokenizer.encode("0123456789ab", add_special_tokens=False)]
    assert _allowed(bitmask[0]).tolist() == expected


def test_terminated_and_rejected_requests_allow_only_eos(byte_manager):
    tokenizer = byte_manager.tokenizer
    byte_manager.add_request("done", StructuredOutputsParams(regex="ab"))
    assert byte_manager.accept_tokens("done", tokenizer.encode("ab", add_special_tokens=False))
    assert byte_manager.is_terminated("done")
    assert _allowed(byte_manager.fill_bitmask(["done"])[0]).tolist() == [EOS_ID]
    assert byte_manager.accept_tokens("done", [EOS_ID])
    assert not byte_manager.accept_tokens("done", [EOS_ID + 1])

    byte_manager.add_request("optional", StructuredOutputsParams(regex="ab1?"))  # complete, not yet terminated
    assert byte_manager.accept_tokens("optional", tokenizer.encode("ab", add_special_tokens=False))
    assert not byte_manager.is_terminated("optional")
    assert byte_manager.accept_tokens("optional", [EOS_ID]) and byte_manager.is_terminated("optional")

    byte_manager.add_request("wrong", StructuredOutputsParams(regex="ab"))
    assert not byte_manager.is_terminated("wrong")
    assert not byte_manager.accept_tokens("wrong", tokenizer.encode("x", add_special_tokens=False))
    assert byte_manager.is_terminated("wrong")
    assert _allowed(byte_manager.fill_bitmask(["wrong"])[0]).tolist() == [EOS_ID]
    for req_id in ("done", "optional", "wrong"):
        byte_manager.remove_request(req_id)


def test_requests_with_one_constraint_advance_independently(byte_manager):
    params = StructuredOutputsParams(choice=["cat", "dog"])
    byte_manager.add_request("a", params)
    byte_manager.add_request("b", params)
    assert byte_manager.accept_tokens("a", byte_manager.tokenizer.encode("ca", add_special_tokens=False))
    rows = byte_manager.fill_bitmask(["a", "b"])
    as_ids = [byte_manager.tokenizer.convert_ids_to_tokens(_allowed(row).tolist()) for row in rows]
    assert as_ids == [["t"], ["c", "d"]]
    for req_id in ("a", "b"):
        byte_manager.remove_request(req_id)


def test_grammar_output_only_for_constrained_requests(byte_manager):
    assert byte_manager.grammar_output(["plain-1", "plain-2"]) is None
    byte_manager.add_request("c1", StructuredOutputsParams(regex="[0-9]+"))
    byte_manager.add_request("c2", StructuredOutputsParams(json=PERSON))
    output = byte_manager.grammar_output(["plain-1", "c2", "plain-2", "c1"])
    assert output.structured_output_request_ids == ["c2", "c1"]
    assert output.grammar_bitmask.shape == (2, 10)
    np.testing.assert_array_equal(output.grammar_bitmask, byte_manager.fill_bitmask(["c2", "c1"]))
    for req_id in ("c1", "c2"):
        byte_manager.remove_request(req_id)
    assert not byte_manager.has("c1") and byte_manager.grammar_output(["c1", "c2"]) is None
    with pytest.raises(KeyError, match="no structured output constraint"):
        byte_manager.fill_bitmask(["c1"])


# ------------------------------------------------------- speculative decoding


def test_drafts_are_cut_to_what_the_grammar_takes_and_get_a_row_each(byte_manager):
    """validate_drafts keeps the leading drafts the grammar takes without completing; fill_bitmask
    gives a row for the next token and one after each draft, and leaves the matcher as it was."""
    ids = lambda text: byte_manager.tokenizer.encode(text, add_special_tokens=False)
    byte_manager.add_request("s", StructuredOutputsParams(choice=["cat", "cow", "dog"]))
    assert byte_manager.validate_drafts("s", ids("cox")) == ids("co")  # x: not in the grammar
    assert byte_manager.validate_drafts("s", ids("cat") + [EOS_ID]) == ids("ca")  # t completes it
    assert byte_manager.validate_drafts("s", ids("z")) == []
    rows = byte_manager.fill_bitmask(["s"], {"s": ids("ca")})
    as_tokens = [byte_manager.tokenizer.convert_ids_to_tokens(_allowed(row).tolist()) for row in rows]
    assert as_tokens == [["c", "d"], ["a", "o"], ["t"]]
    # Nothing was consumed: the next token is still the first.
    np.testing.assert_array_equal(byte_manager.fill_bitmask(["s"])[0], rows[0])
    output = byte_manager.grammar_output(["plain", "s"], {"s": ids("c"), "plain": [5, 6]})
    assert output.structured_output_request_ids == ["s"] and output.grammar_bitmask.shape == (2, 10)
    byte_manager.remove_request("s")


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def without_speculation(cache_dir):
    """Prompts, their parameters (greedy and seeded, all but the last under the schema) and the
    completions of the engine without speculative decoding."""
    llm = tiny_llm(cache_dir, num_gpu_blocks_override=400)
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    example = '{"color":"red","size":12,"ok":true} {"color":"blue","size":7,"ok":false} JSON:'
    prompts = [example, "Give JSON:", example, "Give JSON:", example]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint, logprobs=2),
        SamplingParams(temperature=1.0, seed=1, max_tokens=60, structured_outputs=constraint),
        SamplingParams(temperature=0.7, seed=2, max_tokens=60, structured_outputs=constraint),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    return prompts, params, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "config", [{"method": "ngram"}, {"method": "draft_model", "model": "tiny-llama"}], ids=["ngram", "draft_model"]
)
def test_json_schema_with_speculation(cache_dir, without_speculation, config):
    """Under the schema with drafts verified against a bitmask row each: every output parses and
    validates, and greedy outputs (tokens and logprobs) are those without speculation."""
    prompts, params, expected = without_speculation
    llm = tiny_llm(cache_dir, num_gpu_blocks_override=400, speculative_config={**config, "num_speculative_tokens": 3})
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for completion in got[:-1]:
        assert _conforms(json.loads(completion.text), SCHEMA), completion.text
        assert completion.finish_reason == "stop"
    for i in (0, 4):  # the greedy ones
        assert got[i].token_ids == expected[i].token_ids
    assert_same_logprobs(got[1], expected[1])
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted > 0
