"""Rounds of several decode steps in one program (``SchedulerConfig.num_scheduler_steps``): what they accept.

A round runs the forward and the plain sampling program ``num_decode_steps``
times on the device, each step's tokens the next one's inputs, so it takes
only requests that decode one token a step, sample plainly and are no longer
prefilling; anything else is refused before it is dispatched.
"""

from __future__ import annotations

import numpy as np

from jaxrunner.interfaces import GrammarOutput, SchedulerOutput
from jaxrunner.runner.states import RequestState
from jaxrunner.runner.structured_outputs import uses_grammar


def check_num_decode_steps(steps: int, decode_step_counts: tuple[int, ...]) -> None:
    """Raise ValueError unless the runner compiled rounds of ``steps`` steps (one step always is)."""
    if steps != 1 and steps not in decode_step_counts:
        raise ValueError(
            f"num_decode_steps is {steps}; this runner runs rounds of "
            f"{decode_step_counts} steps (SchedulerConfig.num_scheduler_steps)."
        )


def check_decode_round(
    scheduler_output: SchedulerOutput,
    req_ids: list[str],
    num_scheduled: np.ndarray,
    computed: np.ndarray,
    idx_mapping: np.ndarray,
    req_states: RequestState,
) -> None:
    """Raise ValueError unless a round of several decode steps gives each request one token a
    step, no drafts, a first step that samples (its prompt is in, but for one token at most),
    and the plain sampling program (no stage before the draw, no logprobs)."""
    steps = scheduler_output.num_decode_steps
    if scheduler_output.scheduled_spec_decode_tokens or np.any(num_scheduled != steps):
        raise ValueError(
            f"A round of {steps} decode steps schedules exactly {steps} tokens (one a step) for each "
            "request, and no draft tokens."
        )
    prefilling = computed + 1 < req_states.prefill_len[idx_mapping]
    if np.any(prefilling):
        raise ValueError(
            f"Request {req_ids[int(np.argmax(prefilling))]!r} is still prefilling; a round of several "
            "decode steps takes only requests whose first step samples."
        )
    plain = req_states.plain_sampling[idx_mapping] & (req_states.num_logprobs[idx_mapping] == 0)
    if not plain.all():
        raise ValueError(
            f"Request {req_ids[int(np.argmin(plain))]!r} uses a sampling stage before the draw or "
            "logprobs; a round of several decode steps takes only plainly sampled requests."
        )


def check_round_output(grammar_output: GrammarOutput | None) -> None:
    """Raise ValueError if the round's requests were to be constrained: its program sampled without a grammar."""
    if uses_grammar(grammar_output):
        raise ValueError(
            "A round of several decode steps samples without a grammar; its tokens were not constrained. "
            "Run structured-output requests one step at a time."
        )
