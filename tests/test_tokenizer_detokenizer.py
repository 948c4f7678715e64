"""The byte tokenizer, tokenizer loading, the built-in models and incremental detokenisation.

Besides the byte tokenizer, two small tokenizers are trained here on the fly
(no download): a GPT-2 style byte-level BPE and a Llama style SentencePiece
BPE with byte fallback, whose decoder drops a leading space.
"""

import json
import random

import jax
import jax.numpy as jnp
import pytest
import transformers
from flax import nnx
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.models import CausalLM
from jaxrunner.models.builtin import BUILTIN_MODELS, DEFAULT_DTYPES, is_builtin, load_builtin
from jaxrunner.models.tokenizer import (
    BOS_ID,
    BYTE_OFFSET,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    PAD_ID,
    build_byte_tokenizer,
    load_tokenizer,
)

WORDS = ["hello", "world", "the", "stop", "café", "naïve", "über", "straße", "日本語", "テスト", "good", "\n", "END"]
RARE = ["😀", "🚀👍🏽", "Ω", "€", "ß", "𝄞", "\t", "  "]
TEXTS = ["", "Hello, world!", "héllo wörld", "日本語のテスト", "emoji 😀🚀👍🏽 mixed", "𝄞 clef\n\ttab", "a" * 50]


def _corpus(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n)]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS + RARE) + rng.choice(["", " "]) for _ in range(rng.randint(1, 25)))


def _gpt2_style(corpus: list[str]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def _sentencepiece_style(corpus: list[str]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    trained = json.loads(tok.to_str())["model"]  # add the <0xNN> byte tokens that byte fallback needs
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok.model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module", params=["byte", "gpt2", "sentencepiece"])
def any_tok(request):
    corpus = _corpus(random.Random(0), 300)
    builders = {
        "byte": build_byte_tokenizer,
        "gpt2": lambda: _gpt2_style(corpus),
        "sentencepiece": lambda: _sentencepiece_style(corpus),
    }
    tok = builders[request.param]()
    tok.name_or_path = request.param
    return tok


# ----------------------------------------------------------------- byte tokenizer


def test_byte_tokenizer_ids_are_fixed(byte_tok):
    assert len(byte_tok) == BYTE_VOCAB_SIZE == 259
    assert (byte_tok.pad_token_id, byte_tok.bos_token_id, byte_tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert byte_tok.encode("A\x00\xff") == [BOS_ID] + [BYTE_OFFSET + b for b in (65, 0, 0xC3, 0xBF)]
    assert byte_tok.encode("A", add_special_tokens=False) == [BYTE_OFFSET + 65]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(byte_tok, text):
    ids = byte_tok.encode(text)
    assert ids == [BOS_ID] + [BYTE_OFFSET + b for b in text.encode("utf-8")]
    assert byte_tok.decode(ids, skip_special_tokens=True) == text
    assert byte_tok.decode(ids) == "<s>" + text


def test_byte_tokenizer_chat_template(byte_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    text = byte_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi 😀</s>\n<|assistant|>\n"
    ids = byte_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == byte_tok.encode(text, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 2  # the template's tokens are the special tokens
    without = byte_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("<|assistant|>\n")


def test_load_tokenizer_round_trips_a_saved_tokenizer(byte_tok, tmp_path):
    byte_tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "héllo 😀"
    assert loaded.encode(text) == byte_tok.encode(text)
    assert loaded.decode(loaded.encode(text), skip_special_tokens=True) == text
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<s><|user|>\nx</s>\n"


def test_load_tokenizer_errors_name_the_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no usable tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        load_tokenizer(tmp_path / "missing")


# ----------------------------------------------------------------- built-in models


def test_builtin_tiny_llama_covers_the_tokenizer():
    assert is_builtin("tiny-llama") and not is_builtin("/some/checkpoint")
    model, config, tok = load_builtin("tiny-llama", dtype="float32", seed=1)
    assert config is BUILTIN_MODELS["tiny-llama"]
    assert config.vocab_size % 64 == 0 and len(tok) <= config.vocab_size < len(tok) + 64
    assert model.model.embed_tokens.embedding.get_value().shape == (config.vocab_size, config.hidden_size)
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (2, 128, 4, 2, 32) and config.max_position_embeddings == 2048


def test_builtin_unknown_name_lists_the_builtins():
    with pytest.raises(ValueError, match="tiny-llama"):
        load_builtin("huge-llama", dtype="float32")


# ----------------------------------------------------------------- detokenizer


def _feed(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random, max_chunk: int = 1) -> list[str]:
    """Feeds ``ids`` in random chunks; returns the streamed deltas, checking each step's text."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        assert detok.update(ids[i : i + n]) is None
        assert "\ufffd" not in detok.output_text
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        i += n
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas


def _expected(tok, prompt: list[int], output: list[int]) -> str:
    """The output's text in the prompt's context (a SentencePiece decode drops a leading space)."""
    return tok.decode(prompt + output, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]


@pytest.mark.parametrize("max_chunk", [1, 3])
def test_detokenizer_matches_full_decode(any_tok, max_chunk):
    rng = random.Random(max_chunk)
    for _ in range(40):
        prompt = any_tok.encode(_random_text(rng))
        output = any_tok.encode(_random_text(rng), add_special_tokens=False)
        detok = IncrementalDetokenizer(any_tok, prompt)
        deltas = _feed(detok, output, rng, max_chunk)
        assert detok.output_text == "".join(deltas) == _expected(any_tok, prompt, output)
        if any_tok.name_or_path != "sentencepiece":  # byte-level decodes simply concatenate
            assert detok.output_text == any_tok.decode(output, skip_special_tokens=True)


class _DecodeLog:
    """A tokenizer proxy that records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_detokenizer_decodes_a_short_window(any_tok):
    """Read after every token (as streaming does), each decode covers a few tokens only."""
    log = _DecodeLog(any_tok)
    text = " ".join(["naïve 😀 日本語 hello"] * 60)
    output = any_tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(log, any_tok.encode("prompt"))
    for token in output:
        detok.update([token])
        _ = detok.output_text  # read after every token, as a streaming client does
    assert detok.output_text.lstrip(" ") == text
    assert len(output) > 300 and max(log.sizes) <= 10 and len(log.sizes) <= 2 * len(output) + 1


def test_detokenizer_without_stop_strings_decodes_only_when_read(any_tok):
    """Unread and without stop strings, updates decode nothing; the final text is the same."""
    log = _DecodeLog(any_tok)
    text = " ".join(["naïve 😀 日本語 hello"] * 20)
    output = any_tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(log, any_tok.encode("prompt"))
    decodes_at_start = len(log.sizes)
    for token in output[:-1]:
        detok.update([token])
    assert len(log.sizes) == decodes_at_start
    detok.update(output[-1:], finished=True)
    assert detok.output_text.lstrip(" ") == text
    assert len(log.sizes) - decodes_at_start <= 2


def test_detokenizer_holds_back_split_characters(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("Hi"))
    emoji = byte_tok.encode("😀", add_special_tokens=False)
    assert len(emoji) == 4
    for token in emoji[:-1]:
        detok.update([token])
        assert detok.output_text == "" and detok.get_next_output_text(False, True) == ""
    detok.update(emoji[-1:])
    assert detok.output_text == "😀"


def test_detokenizer_random_bytes_never_show_incomplete_characters(byte_tok):
    """Arbitrary ids (invalid UTF-8, specials): the text is the full decode less a pending tail."""
    rng = random.Random(7)
    for _ in range(30):
        output = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(rng.randint(1, 60))]
        detok = IncrementalDetokenizer(byte_tok, [BOS_ID])
        text = ""
        for token in output:
            detok.update([token])
            assert not detok.output_text.endswith("\ufffd")
            assert detok.output_text.startswith(text)
            text = detok.output_text
        full = byte_tok.decode(output, skip_special_tokens=True)
        assert text == full.rstrip("\ufffd")
        assert detok.update([], finished=True) is None and detok.output_text == full


def test_detokenizer_flushes_an_incomplete_character_when_finished(byte_tok):
    e2, x82 = BYTE_OFFSET + 0xE2, BYTE_OFFSET + 0x82  # the first two of the three bytes of "€"
    detok = IncrementalDetokenizer(byte_tok, [BOS_ID], stop=["\ufffd"])
    detok.update([BYTE_OFFSET + ord("a")])
    assert detok.update([e2]) is None and detok.output_text == "a"
    assert detok.update([x82], finished=True) == "\ufffd" and detok.output_text == "a"
    detok = IncrementalDetokenizer(byte_tok, [BOS_ID])
    detok.update([e2, x82])
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update([], finished=True)
    assert detok.get_next_output_text(finished=True, delta=True) == "\ufffd" == byte_tok.decode([e2, x82])


def test_detokenizer_keeps_special_tokens_when_asked(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [BOS_ID], skip_special_tokens=False)
    detok.update(byte_tok.encode("ok", add_special_tokens=False) + [EOS_ID])
    assert detok.output_text == "ok</s>"
    ids = byte_tok.encode("ok", add_special_tokens=False) + [EOS_ID]
    for include, text in [(False, "ok"), (True, "ok</s>")]:
        detok = IncrementalDetokenizer(
            byte_tok, [BOS_ID], skip_special_tokens=False, include_stop_str_in_output=include
        )
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.output_text == text


# ----------------------------------------------------------------- stop strings


def _run_until_stop(tok, text: str, stop: list[str], include: bool) -> tuple[str | None, str]:
    """Streams ``text`` one token at a time until a stop string; returns it and the final text.

    Checks that the stream is the final text and that nothing streamed is ever
    taken back. The space a SentencePiece encoding prepends is left out.
    """
    prompt, ids = tok.encode("prompt"), tok.encode(text, add_special_tokens=False)
    lead = _expected(tok, prompt, ids)[: -len(text)]
    assert lead in ("", " ")
    detok = IncrementalDetokenizer(tok, prompt, stop=stop, include_stop_str_in_output=include)
    streamed, found = "", None
    for token in ids:
        found = detok.update([token])
        if found is not None:
            break
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert detok.output_text.startswith(streamed)
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == detok.output_text and streamed.startswith(lead)
    return found, streamed[len(lead) :]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_truncates(any_tok, include):
    found, text = _run_until_stop(any_tok, "good morning café STOP here, STOP again", ["STOP"], include)
    assert found == "STOP"
    assert text == ("good morning café STOP" if include else "good morning café ")


def test_stop_string_with_multibyte_characters(byte_tok):
    found, text = _run_until_stop(byte_tok, "naïve 日本語 then 😀 end", ["語 th", "😀"], include=False)
    assert (found, text) == ("語 th", "naïve 日本")


def test_stop_string_earliest_match_wins(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [BOS_ID], stop=["world", "lo"])
    assert detok.update(byte_tok.encode("hello world", add_special_tokens=False)) == "lo"
    assert detok.output_text == "hel"


def test_stop_string_that_never_appears(any_tok):
    found, text = _run_until_stop(any_tok, "hello world stop here", ["STOP", "xyz"], include=False)
    assert (found, text) == (None, "hello world stop here")


def test_stop_string_not_searched_in_prompt(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("say STOP"), stop=["STOP"])
    assert detok.update(byte_tok.encode(" ok", add_special_tokens=False)) is None


def test_streaming_never_shows_a_partial_stop_string(any_tok):
    rng = random.Random(3)
    for _ in range(40):
        text = _random_text(rng)
        stop = rng.choice([["END"], ["world", "日本語"], ["😀"], ["ü", "naïve g"], ["absent!"]])
        include = rng.random() < 0.5
        found, streamed = _run_until_stop(any_tok, text, stop, include)
        assert "\ufffd" not in streamed
        starts = {s: text.find(s) for s in stop if s in text}
        if starts:
            first = min(starts, key=lambda s: (starts[s], stop.index(s)))
            assert found == first
            assert streamed == text[: starts[first] + (len(first) if include else 0)]
        else:
            assert (found, streamed) == (None, text)


def test_full_text_holds_back_the_stop_buffer(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [BOS_ID], stop=["STOP"])
    assert detok.stop_buffer_length == 3
    detok.update(byte_tok.encode("abcST", add_special_tokens=False))
    assert detok.get_next_output_text(finished=False, delta=False) == "ab"
    assert detok.get_next_output_text(finished=True, delta=False) == "abcST"
    assert IncrementalDetokenizer(byte_tok, [], stop=["STOP"], include_stop_str_in_output=True).stop_buffer_length == 0


@pytest.mark.parametrize("name, params", [("random-llama3-8b", 8_030_261_248), ("random-llama3-70b", 70_553_706_496)])
def test_builtin_llama3_shapes_have_the_published_parameter_counts(name, params):
    """Built abstractly (no memory): the counts of Llama-3.1-8B's and -70B's checkpoints."""
    config = BUILTIN_MODELS[name]
    model = nnx.eval_shape(lambda: CausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == params
    assert DEFAULT_DTYPES[name] == "bfloat16"
