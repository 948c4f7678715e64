"""Incremental detokenisation with stop strings, as vLLM's V1 output processor does it.

Each update decodes only a short window of recent tokens: the *prefix* (tokens
whose text was already emitted, kept as context because decoders such as
SentencePiece's drop a leading space at the start of a decode) and the tokens
not yet emitted. The new text is the window's text minus the prefix's. While
the window's text ends in U+FFFD, the last character is an incomplete UTF-8
sequence (a byte-level token split it) and nothing is emitted until a later
token completes it. When the sequence finishes, whatever is still held back is
added as decoded, so the final text is the full decode of the output tokens
(in the prompt's context). Without stop strings nothing needs the text until it
is read, so tokens are only collected and decoded when ``output_text`` is read
(at most once a step while streaming, once in all for a final-only output).
"""

from collections.abc import Sequence

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded as the first prefix (vLLM's initial offset)


class IncrementalDetokenizer:
    """The text of one sequence, grown token by token, stopped at the first stop string.

    ``stop`` strings are searched in the output text only (never the prompt);
    empty ones are ignored. Where several complete in the same update, the one
    that starts first wins, ties going to the first listed (vLLM takes the
    first in list order).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streaming holds back this many chars: a stop string may be starting there and would be cut.
        excluded = self.stop and not include_stop_str_in_output
        self.stop_buffer_length = max(map(len, self.stop)) - 1 if excluded else 0
        self._text = ""
        self._streamed = 0  # chars of output_text already returned by get_next_output_text
        # The window: prefix tokens are window[:_read], unemitted ones window[_read:].
        self._window = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)

    def update(
        self, new_token_ids: Sequence[int], *, finished: bool = False, stop_terminated: bool = False
    ) -> str | None:
        """Appends generated tokens; returns the stop string now in the output text, else None.

        On a match ``output_text`` is cut just before the stop string (just after
        it with ``include_stop_str_in_output``) and the sequence is finished: do
        not update it again. ``finished`` says these are the last tokens (or, with
        none, that the sequence has ended): a character still incomplete will never
        be, so the text held back for it is added as decoded, U+FFFD included:
        ``output_text`` then is the full decode of the output tokens.
        ``stop_terminated`` (implies ``finished``) says the last token is an eos or
        stop token id; as in vLLM its text is left out unless
        ``include_stop_str_in_output``.
        """
        finished = finished or stop_terminated
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        if not new_token_ids and not finished:
            return None
        self._window.extend(map(int, new_token_ids))
        if not self.stop and not finished:
            return None  # decoded when the text is read
        new_text = self._emit(finished)
        self._text += new_text
        return self._check_stop(len(new_text))

    @property
    def output_text(self) -> str:
        """The text so far: the output tokens decoded, less any incomplete last character."""
        if len(self._window) > self._read:
            self._text += self._emit(False)
        return self._text

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream: new since the last call if ``delta``, else all of it.

        Until ``finished`` the last ``stop_buffer_length`` chars are held back, so
        a stop string's beginning (later cut off) is never streamed.
        """
        end = max(len(self.output_text) - (0 if finished else self.stop_buffer_length), 0)
        if not delta:
            return self.output_text[:end]
        start, self._streamed = self._streamed, max(self._streamed, end)
        return self.output_text[start:end]

    def _emit(self, final: bool) -> str:
        """The window's new text, unless (and not ``final``) it ends in an incomplete character.

        Emitted tokens become the prefix.
        """
        text = self._decode(self._window)
        if not final and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR)):
            return ""
        del self._window[: self._read]
        self._read = len(self._window)
        new_text = text[len(self._prefix_text) :]
        if not final:  # nothing is emitted after the final text
            self._prefix_text = self._decode(self._window)
        return new_text

    def _check_stop(self, new_chars: int) -> str | None:
        """Finds a stop string overlapping the last ``new_chars`` chars and cuts the text there."""
        if not self.stop or not new_chars:
            return None
        text = self._text
        found: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self._text = text[: index + len(stop) if self.include_stop_str_in_output else index]
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
