"""N-gram prompt-lookup proposer: draft tokens copied from earlier in the history.

Mirrors vLLM's V1 ``NgramProposer``. The suffix of a request's history is
looked up earlier in that same history; the tokens that followed the match
become the draft. It runs on the host in NumPy every step, so the search is
vectorised: one pass over the history per n-gram length, never a Python loop
over token positions.

Match rule (as in vLLM): the LONGEST suffix n-gram with
``prompt_lookup_min <= n <= prompt_lookup_max`` that occurs earlier wins, and
among occurrences of that n-gram the FIRST (leftmost) one is used. An earlier
occurrence may overlap the suffix itself, but it must end before the last
token, so at least one following token exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Propose up to ``num_speculative_tokens`` draft tokens by prompt lookup."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 3,
        max_model_len: int | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 or None, got {max_model_len}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray | Sequence[int]) -> list[int]:
        """Draft tokens for one request's whole history (prompt + generated).

        Returns ``[]`` when no suffix n-gram recurs, and never so many tokens
        that ``len(token_ids) + len(draft)`` exceeds ``max_model_len``.
        """
        history = np.asarray(token_ids)
        if history.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {history.shape}")
        length = history.shape[0]
        k = self.num_speculative_tokens
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - length)
        if k <= 0:
            return []
        end = self._leftmost_longest_match_end(history)
        if end < 0:
            return []
        return history[end + 1 : end + 1 + k].tolist()

    def _leftmost_longest_match_end(self, history: np.ndarray) -> int:
        """End index of the leftmost earlier occurrence of the longest suffix n-gram, or -1.

        ``alive[e]`` says the window ending at ``e`` (``e <= len - 2``) still
        matches the suffix after ``m + 1`` tokens compared right to left;
        growing ``m`` one step is a single vectorised comparison of the
        history, shifted by ``m``, against one suffix token.
        """
        length = history.shape[0]
        # A window ending at e <= length - 2 holds at most length - 1 tokens.
        longest = min(self.prompt_lookup_max, length - 1)
        if longest < self.prompt_lookup_min:
            return -1
        alive = np.ones(length - 1, dtype=bool)
        best_end, best_n = -1, 0
        for m in range(longest):
            # Windows ending before m are shorter than m + 1 tokens.
            alive[:m] = False
            alive[m:] &= history[: length - 1 - m] == history[length - 1 - m]
            first = int(np.argmax(alive))
            if not alive[first]:
                break
            best_end, best_n = first, m + 1
        return best_end if best_n >= self.prompt_lookup_min else -1
