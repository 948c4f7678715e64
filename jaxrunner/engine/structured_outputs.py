"""Structured outputs: generation constrained to a JSON schema, a regex, a choice or a grammar.

As in vLLM, a request asks for it with
``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` (or
``regex=``, ``choice=``, ``grammar=``). The ``StructuredOutputManager`` keeps a
grammar matcher per constrained request. Each step it fills an int32 bitmask
of the tokens each request may take next (bit ``v % 32`` of word ``v // 32``
allows token ``v``), which the runner applies to the logits before sampling;
after sampling, the sampled tokens advance the matchers.

With speculative decoding a request's drafts are first cut to those the
grammar takes (``validate_drafts``); the step then gets a bitmask row for the
next token and one after each draft, built by advancing the matcher through
the drafts and rolling it back, so every verified row is constrained as the
token it scores would be without speculation.

The grammar engine is llguidance (vLLM's "guidance" backend): a single abi3
wheel with no Python dependencies, fast enough to compute masks on the fly
(no per-grammar precomputation over the vocabulary), and it reads any
HuggingFace fast tokenizer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from typing import TYPE_CHECKING, Any, cast

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import transformers

from jaxrunner.interfaces import GrammarOutput

if TYPE_CHECKING:
    # A TypedDict of llguidance's stubs only (_lib.pyi): there is no such class at run time.
    from llguidance._lib import JsonCompileOptions

_KINDS = ("json", "regex", "choice", "grammar")
_EXPECTED = {
    "json": "a JSON schema (a dict or its JSON text)",
    "regex": "a string",
    "choice": "a non-empty list of strings",
    "grammar": "a string",
}


@dataclasses.dataclass
class StructuredOutputsParams:
    """What a request's output must match; exactly one of ``json``, ``regex``, ``choice``, ``grammar``.

    ``json`` is a JSON schema (a dict, or its JSON text); ``regex`` must match
    the whole output and uses Rust regex syntax (no look-around or
    backreferences); ``choice`` lists the allowed outputs; ``grammar`` is a Lark
    or GBNF grammar. ``disable_any_whitespace`` (vLLM's flag) makes JSON output
    compact instead of allowing whitespace between its tokens.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(_KINDS)}; got {', '.join(given) or 'none'}."
            )
        value = getattr(self, self.kind)
        valid = {
            "json": isinstance(value, (dict, str)),
            "regex": isinstance(value, str),
            "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
            "grammar": isinstance(value, str),
        }[self.kind]
        if not valid:
            raise ValueError(f"StructuredOutputsParams.{self.kind} must be {_EXPECTED[self.kind]}; got {value!r}.")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice" or "grammar"."""
        return next(kind for kind in _KINDS if getattr(self, kind) is not None)


def _llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar definition (a string that also keys the cache)."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {error}") from error
        options: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    assert params.grammar is not None  # __post_init__: exactly one of the kinds is given
    return llguidance.grammar_from("grammar", params.grammar)


class StructuredOutputManager:
    """The grammar matchers of the constrained requests, and their next-token bitmasks.

    ``vocab_size`` is the model's (the width of its logits). It may differ from
    the tokenizer's: ids past the tokenizer are never allowed, and ids past
    ``vocab_size`` are cut off the masks. Compiled grammars are cached by their
    definition, so requests with the same constraint share the compile.
    """

    CACHE_SIZE = 256
    """How many compiled grammars to keep (least recently used dropped first)."""

    def __init__(self, tokenizer: transformers.PreTrainedTokenizerBase, vocab_size: int):
        if tokenizer.eos_token_id is None:
            raise ValueError("Structured outputs need a tokenizer with an EOS token, to end the constrained text.")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # transformers serves eos_token_id from __getattr__ (convert_tokens_to_ids of one token: an int);
        # pyright infers the union of every return of that method.
        self.eos_token_id: int = cast(int, tokenizer.eos_token_id)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._executor = llguidance.LLExecutor()

    @functools.cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer; built on first use, as it takes about a second for a large vocabulary."""
        # llguidance needs room for every tokenizer id, even where the model has fewer.
        n_vocab = max(self.vocab_size, len(self.tokenizer))
        # from_tokenizer reads fast tokenizers only, and raises ValueError itself for any other.
        tokenizer = cast(transformers.PreTrainedTokenizerFast, self.tokenizer)
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=self.eos_token_id)

    def add_request(self, req_id: str, params: object) -> None:
        """Constrain ``req_id`` by ``params``, the user's ``SamplingParams.structured_outputs``; raises
        ValueError (adding nothing) if it is no ``StructuredOutputsParams`` or its constraint is invalid."""
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(
                f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}."
            )
        if req_id in self._matchers:
            raise ValueError(f"Request {req_id!r} is already constrained.")
        grammar = _llguidance_grammar(params)
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"Invalid structured output {params.kind}: {template.get_error()}")
            self._compiled[grammar] = template
            if len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        self._matchers[req_id] = template.deep_copy()

    @property
    def num_requests(self) -> int:
        """How many requests are constrained now."""
        return len(self._matchers)

    def has(self, req_id: str) -> bool:
        """Whether ``req_id`` is constrained."""
        return req_id in self._matchers

    def remove_request(self, req_id: str) -> None:
        """Forget ``req_id`` (finished or aborted); unconstrained ids are ignored."""
        self._matchers.pop(req_id, None)

    def fill_bitmask(self, req_ids: list[str], drafts: dict[str, list[int]] | None = None) -> np.ndarray:
        """int32 ``[rows, ceil(vocab_size / 32)]``: per request of ``req_ids`` in order, a row of the
        tokens it may take next, then (speculative decoding) one after each of its ``drafts``.

        The drafts must be ones ``validate_drafts`` kept: the matcher takes each of them,
        and is rolled back after. A terminated request (its grammar complete, or broken by
        a disallowed token) allows only EOS. The rows are computed in parallel.
        """
        drafts = drafts or {}
        plain, drafted, row = [], [], 0
        for req_id in req_ids:
            request_drafts = list(drafts.get(req_id, ()))
            if request_drafts:
                drafted.append((self._matcher(req_id), row, request_drafts))
            else:
                plain.append((self._matcher(req_id), row))
            row += 1 + len(request_drafts)
        shape = llguidance.numpy.get_bitmask_shape(row, self._ll_tokenizer.vocab_size)
        bitmask = np.zeros(shape, dtype=np.int32)
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:  # llguidance takes no empty draft lists there
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return self._cut_to_vocab(bitmask)

    def validate_drafts(self, req_id: str, drafts: list[int]) -> list[int]:
        """The leading ``drafts`` the grammar takes without completing: the rest could never be
        emitted (a disallowed token is rejected; after a completing one the request ends, as it
        does without speculation), so they are not verified. The matcher is left as it was."""
        matcher = self._matcher(req_id)
        consumed = 0
        for token in drafts[: matcher.validate_tokens(list(drafts))]:
            matcher.consume_token(int(token))  # validated: taken
            consumed += 1
            if matcher.is_stopped():
                break
        kept = consumed - int(matcher.is_stopped())
        matcher.rollback(consumed)
        return list(drafts[:kept])

    def _cut_to_vocab(self, bitmask: np.ndarray) -> np.ndarray:
        """Drop the ids past ``vocab_size`` (there only when the tokenizer is larger than the model)."""
        if self._ll_tokenizer.vocab_size == self.vocab_size:
            return bitmask
        bitmask = np.ascontiguousarray(bitmask[:, : -(-self.vocab_size // 32)])
        if self.vocab_size % 32:
            bitmask[:, -1] &= np.int32((1 << self.vocab_size % 32) - 1)
        return bitmask

    def accept_tokens(self, req_id: str, token_ids: list[int]) -> bool:
        """Advance ``req_id`` by its sampled tokens; False if one was not allowed.

        After a False the request is terminated: its mask allows only EOS.
        """
        matcher = self._matcher(req_id)
        for token in token_ids:
            if matcher.is_stopped():
                # A complete grammar takes EOS, which ends the text (llguidance itself would refuse it here).
                return int(token) == self.eos_token_id and not matcher.is_error()
            if not matcher.consume_token(int(token)):
                return False
        return True

    def is_terminated(self, req_id: str) -> bool:
        """Whether ``req_id`` can take nothing but EOS (grammar complete, EOS taken, or an error)."""
        return self._matcher(req_id).is_stopped()

    def grammar_output(self, req_ids: list[str], drafts: dict[str, list[int]] | None = None) -> GrammarOutput | None:
        """The bitmasks of the constrained requests among ``req_ids``, in their order (vLLM's layout:
        each request's row, then one after each of its scheduled ``drafts``); None if there are none."""
        constrained = [req_id for req_id in req_ids if req_id in self._matchers]
        if not constrained:
            return None
        return GrammarOutput(
            structured_output_request_ids=constrained, grammar_bitmask=self.fill_bitmask(constrained, drafts)
        )

    def _matcher(self, req_id: str) -> llguidance.LLMatcher:
        try:
            return self._matchers[req_id]
        except KeyError:
            raise KeyError(f"Request {req_id!r} has no structured output constraint.") from None
