"""Tokenizers: a checkpoint's own, or a byte-level one built locally for the built-in models.

The byte tokenizer needs no download: one token per byte plus three special
tokens, with fixed ids::

    0 <pad>    1 <s> (bos)    2 </s> (eos)    3 + b  the byte b (0..255)

so its vocabulary has 259 entries. ``encode(text)`` is bos followed by the
UTF-8 bytes of ``text``, and decoding gives the text back exactly (as with any
HF tokenizer, a literal ``<s>``, ``</s>`` or ``<pad>`` in the text is read as
that special token, which is how the chat template marks turns). Like GPT-2,
each byte is stored as a printable stand-in character, so the tokenizer is an
ordinary byte-level BPE (with no merges) that HF tooling understands.
"""

from os import PathLike
from pathlib import Path

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxrunner.models.safetensors_io import check_json_files

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
"""The id of byte ``b`` is ``BYTE_OFFSET + b``."""
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256

# Role headers, each turn ending with eos so a model learns to stop there.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_stand_ins() -> list[str]:
    """GPT-2's printable character for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unprintable = [b for b in range(256) if b not in printable]
    return [chr(b) if b in printable else chr(256 + unprintable.index(b)) for b in range(256)]


def build_byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The byte-level tokenizer of the built-in models (ids in the module docstring)."""
    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    vocab.update({char: BYTE_OFFSET + b for b, char in enumerate(_byte_stand_ins())})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        chat_template=BYTE_CHAT_TEMPLATE,
    )


def load_tokenizer(model_dir: str | PathLike) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer saved with a local HF checkpoint; never downloads.

    Raises ``FileNotFoundError`` naming ``model_dir`` when it is not a directory
    or holds no tokenizer that transformers can load (its own error is appended),
    and ``CheckpointError`` naming the file when one of its JSON files does not parse.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such model directory")
    try:
        return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        check_json_files(model_dir, TOKENIZER_JSON_FILES)  # names a file that does not parse
        raise FileNotFoundError(
            f"{model_dir}: no usable tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, "
            f"vocab.json + merges.txt...): add the tokenizer's files, or pass skip_tokenizer_init=True to LLM "
            f"and give prompts as token ids. ({error})"
        ) from error
