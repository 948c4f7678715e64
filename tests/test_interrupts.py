"""Interrupts, exceptions, closed and aborted streams: the engine is left ready and clean every time.

A KeyboardInterrupt is raised into the calling thread from a timer thread at
seeded random moments of ``generate`` and ``stream`` (as a notebook's
interrupt lands); exceptions are raised from inside a step and while a call
adds its prompts; streams are closed early and aborted. After each, no
request, block or slot may be left, and the next call must return exactly the
tokens a fresh engine returns (greedy). Every test runs under a deadline, so
a hang fails it instead of stalling the suite.
"""

import contextlib
import ctypes
import gc
import random
import signal
import threading
import time
from typing import Any, cast

import jax
import numpy as np
import pytest
from runner_driver import tiny_llm
from test_spec_decode_async import spec

from jaxrunner import SamplingParams
from jaxrunner.engine.llm import LLM
from jaxrunner.runner.spec_decode.ngram import NO_DRAFT

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def token_prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


PROMPTS = token_prompts(0, (5, 40, 17, 70, 9))
DEADLINE_S = 120


class Hang(BaseException):
    """A test ran past its deadline."""


@pytest.fixture(autouse=True)
def deadline():
    """Fail (not stall) a test that runs past ``DEADLINE_S``: SIGALRM raises ``Hang`` in it."""

    def expire(signum, frame):
        raise Hang(f"the test ran past its {DEADLINE_S} s deadline")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


# Engines the core checks run on: plain, and speculative under async scheduling (drafts, rejected
# counts and a draft model's KV cache on the device), on fewer buckets to compile. The draft model's
# cache of 12 blocks preempts requests whose drafts are in flight.
SPEC_BUCKETS: dict[str, Any] = {"token_buckets": [16, 64], "request_buckets": [4]}
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ngram_gpu": {"speculative_config": spec("ngram_gpu"), **SPEC_BUCKETS},
    "draft_model": {
        "speculative_config": spec("draft_model", model="tiny-llama"),
        "num_gpu_blocks_override": 12,
        **SPEC_BUCKETS,
    },
}
EVERY_ENGINE = pytest.mark.parametrize("engine_kind", list(ENGINE_OPTIONS), indirect=True)


@pytest.fixture(scope="module")
def engine_kind(request) -> str:
    """Which of ``ENGINE_OPTIONS`` the module's engines are: "plain" unless a test asks for others."""
    return getattr(request, "param", "plain")


@pytest.fixture(scope="module")
def llm(cache_dir, engine_kind):
    """One engine (async scheduling, prefix caching) that every test interrupts again and again."""
    return tiny_llm(cache_dir, **ENGINE_OPTIONS[engine_kind])


@pytest.fixture(scope="module")
def fresh(llm):
    """The tokens of PROMPTS on the engine before anything was interrupted."""
    return greedy_tokens(llm)


def greedy_tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def streamed_tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for delta in llm.stream(prompts, GREEDY):
        tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return in_prompt_order(tokens)


def in_prompt_order(tokens: dict[str, list[int]]) -> list[list[int]]:
    """Each prompt's tokens, by request id (a call numbers its prompts in order)."""
    return [tokens[i] for i in sorted(tokens, key=int)]


def assert_nothing_left(llm: LLM) -> None:
    """No request in the scheduler, the output processor or the runner; every KV block free; no
    device buffer deleted; no step in flight."""
    engine = llm.llm_engine
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert engine.num_unfinished_prompts == 0 and not engine.has_unfinished_requests()
    assert llm.kv_cache_manager.num_free_blocks == llm.kv_cache_manager.num_usable_blocks, "KV blocks leaked"
    runner = engine.runner
    assert runner.req_states.req_id_to_index == {} and runner.req_states.num_staged == 0, "runner slots leaked"
    assert runner.execute_model_state is None
    buffers = jax.tree.leaves((runner.kv_caches, runner.draft_kv_caches, runner.device_state))
    assert not any(b.is_deleted() for b in buffers), "the runner holds donated buffers"


def assert_no_draft_left(llm: LLM) -> None:
    """After a recovery: no slot holds drafts on the device (the next occupant must not verify them)."""
    runner = llm.llm_engine.runner
    if runner.num_spec:
        assert (np.asarray(runner.device_state.draft_tokens) == NO_DRAFT).all(), "drafts left in freed slots"


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode boundary (None: cancel one pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class InterruptAfter:
    """Raises KeyboardInterrupt into the thread that enters it after ``delay`` seconds, unless the block
    ended first; ``fired`` says whether it was raised. An interrupt raised too late to land inside the
    block is cancelled, or lands in ``__exit__``, so it never escapes into the test."""

    def __init__(self, delay: float):
        self._target = threading.get_ident()
        self._lock = threading.Lock()
        self._armed = True
        self.fired = False
        self._timer = threading.Timer(delay, self._fire)

    def _fire(self) -> None:
        with self._lock:
            if self._armed:
                self._armed, self.fired = False, True
                _set_async_exc(self._target, KeyboardInterrupt)

    def __enter__(self) -> "InterruptAfter":
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            self._armed = False
            _set_async_exc(self._target, None)
        self._timer.cancel()


def run_interrupted(call, delay: float):
    """``(interrupted, result)``: ``call()`` with a KeyboardInterrupt raised into it after ``delay`` s."""
    interrupter = InterruptAfter(delay)
    try:
        with interrupter:
            return False, call()
    except KeyboardInterrupt:
        if not interrupter.fired:
            raise
        return True, None


def _duration(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@EVERY_ENGINE
@pytest.mark.parametrize("entry", [greedy_tokens, streamed_tokens], ids=["generate", "stream"])
def test_keyboard_interrupts_at_random_moments(llm, fresh, entry):
    duration = min(_duration(lambda: entry(llm)) for _ in range(3))  # delays fall inside the calls
    rng = random.Random(1234)
    interrupted = 0
    for _ in range(16):
        hit, result = run_interrupted(lambda: entry(llm), rng.uniform(0.0, duration))
        interrupted += hit
        if not hit:
            assert result == fresh  # the interrupt came after the call, or was swallowed where it landed
        assert_nothing_left(llm)
        assert greedy_tokens(llm) == fresh
        assert_nothing_left(llm)
    assert interrupted >= 8, f"only {interrupted} of 16 calls were interrupted: the delays miss the calls"


@EVERY_ENGINE
@pytest.mark.parametrize("program_call", [0, 1, 2, 5, 9])
def test_an_interrupt_after_a_program_took_its_donated_buffers(llm, fresh, monkeypatch, program_call):
    """The interrupt lands after the runner's ``program_call``-th program call took its donated inputs
    (KV caches, device state) and before the runner stored the outputs: the buffers it holds are deleted."""
    runner = llm.llm_engine.runner
    call = runner._call
    calls = []

    def call_then_interrupt(program, *args):
        outputs = call(program, *args)
        calls.append(program)
        if len(calls) == program_call + 1:
            raise KeyboardInterrupt
        return outputs

    monkeypatch.setattr(runner, "_call", call_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        greedy_tokens(llm)
    monkeypatch.undo()
    assert_nothing_left(llm)
    assert_no_draft_left(llm)
    assert greedy_tokens(llm) == fresh


@pytest.fixture(scope="module")
def reference(cache_dir, engine_kind):
    """A second engine of the same kind, never interrupted: what a fresh engine returns."""
    return tiny_llm(cache_dir, **ENGINE_OPTIONS[engine_kind])


def test_a_step_cut_short_ends_each_prompt_of_the_engine_with_an_abort_output(llm, fresh, monkeypatch):
    """Through ``LLMEngine`` itself: the step that raised leaves every prompt aborted, and the next
    ``step()`` returns each one's final output (CUMULATIVE: the tokens it had)."""
    engine = llm.llm_engine
    for request_id, prompt in zip("ab", PROMPTS):
        assert engine.add_request(request_id, prompt, GREEDY) is None
    for _ in range(3):
        engine.step()
    call = engine.runner._call

    def interrupted(program, *args):
        call(program, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "_call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert engine.has_unfinished_requests()  # the aborted prompts' outputs, for the next step
    finals = {o.request_id: o for o in engine.step()}
    assert sorted(finals) == ["a", "b"]
    for output in finals.values():
        assert output.finished and output.outputs[0].finish_reason == "abort"
        assert 0 < len(output.outputs[0].token_ids) < 24  # GREEDY.max_tokens
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh


@EVERY_ENGINE
@pytest.mark.parametrize(
    "where",
    [
        "scheduler.schedule",
        "scheduler.update_from_output",
        "runner.execute_model",
        "runner.sample_tokens",
        "output_processor.process",
    ],
)
def test_an_exception_that_cuts_a_step_short(llm, reference, monkeypatch, where):
    """Raised right after the second step's call of ``where`` did its work (blocks allocated and
    registered in the prefix cache, requests added to the runner, tokens applied...). The prompts
    are new to the engine, so no KV block holds their keys and values from an earlier call."""
    prompts = token_prompts(len(where), (5, 40, 17, 70))
    engine = llm.llm_engine
    owner_name, method = where.split(".")
    owner = getattr(engine, owner_name)
    original = getattr(owner, method)
    calls = []

    def fail_after_the_second(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug inside the step")
        return result

    monkeypatch.setattr(owner, method, fail_after_the_second)
    with pytest.raises(RuntimeError, match="a bug inside the step"):
        streamed_tokens(llm, prompts)
    monkeypatch.undo()
    assert_nothing_left(llm)
    assert_no_draft_left(llm)
    assert greedy_tokens(llm, prompts) == greedy_tokens(reference, prompts)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (None, TypeError, r"prompts\[2\] must be text, token ids or a dict"),
        (np.array([5.0, 6.0]), TypeError, r"prompts\[2\] is a NumPy array of float64"),
        ([5, "6"], TypeError, r"prompts\[2\]\[1\] is '6'"),
        (
            {"prompt_token_ids": [5], "multi_modal_uuids": {}},
            ValueError,
            r"prompts\[2\] has keys \['multi_modal_uuids'\]",
        ),
    ],
)
def test_a_bad_prompt_in_the_middle_fails_before_any_prompt_enters(llm, fresh, monkeypatch, bad, error, match):
    added = []
    monkeypatch.setattr(llm.llm_engine.scheduler, "add_request", added.append)
    prompts = PROMPTS[:2] + [bad] + PROMPTS[2:]
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(error, match=match):
        llm.stream(prompts, GREEDY)
    assert added == []
    monkeypatch.undo()
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh


def test_an_exception_while_preparing_the_third_prompt_queues_none(llm, fresh, monkeypatch):
    """Prompts are all checked and made into requests before the first is queued: a failure while
    preparing one (here a parameter changed to a wrong type after construction) queues none."""
    broken = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    broken.max_tokens = cast(Any, "24")
    added = []
    monkeypatch.setattr(llm.llm_engine.scheduler, "add_request", added.append)
    with pytest.raises(TypeError):
        llm.generate(PROMPTS, [GREEDY, GREEDY, broken, GREEDY, GREEDY], use_tqdm=False)
    assert added == []
    monkeypatch.undo()
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh


def test_a_call_asking_for_too_many_sequences_fails_before_any_prompt_enters(llm, fresh, monkeypatch):
    monkeypatch.setattr(llm, "max_sequences_per_call", 8)
    many = SamplingParams(n=3, temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match=r"asks for 9 sequences .* more than LLM.max_sequences_per_call \(8\)"):
        llm.generate(PROMPTS[:3], many, use_tqdm=False)
    assert_nothing_left(llm)
    assert len(llm.generate(PROMPTS[:2], many, use_tqdm=False)[1].outputs) == 3  # 6 sequences: within the limit
    assert greedy_tokens(llm) == fresh


@pytest.mark.parametrize("how", ["break", "close", "drop"])
def test_closing_a_stream_aborts_its_prompts(llm, fresh, how):
    if how == "break":
        for _ in llm.stream(PROMPTS, GREEDY):
            break
    else:
        stream = llm.stream(PROMPTS, GREEDY)
        for _ in range(3):
            next(stream)
        assert llm.llm_engine.num_unfinished_prompts > 0
        if how == "close":
            stream.close()
        else:
            del stream
            gc.collect()
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh


def test_abort_request_mid_stream_ends_the_prompt_with_an_abort_output(llm, fresh):
    stream = llm.stream(PROMPTS, GREEDY)
    first = next(stream)
    llm.llm_engine.abort_request([first.request_id])
    last = {}
    for delta in stream:
        last[delta.request_id] = delta
    aborted = last[first.request_id]
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert [o.outputs[0].finish_reason for i, o in last.items() if i != first.request_id] == ["length"] * 4
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh


def test_an_abort_asked_for_inside_a_step_is_applied_at_its_end(llm, fresh, monkeypatch):
    """As a stream's finalizer run by the garbage collector in the middle of another call's step does:
    the abort waits for the step to end, then ends every prompt with an abort output."""
    engine = llm.llm_engine
    stream = llm.stream(PROMPTS, GREEDY)
    next(stream)
    schedule = engine.scheduler.schedule

    def schedule_then_abort_all():
        scheduled = schedule()
        monkeypatch.undo()
        engine.abort_request(engine.unfinished_prompt_ids)
        return scheduled

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_then_abort_all)
    finals = [o for o in stream if o.finished]
    assert [o.outputs[0].finish_reason for o in finals] == ["abort"] * len(PROMPTS)
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh


def test_a_generate_while_a_stream_is_open_leaves_the_stream_its_outputs(llm, fresh):
    stream = llm.stream(PROMPTS, GREEDY)
    tokens: dict[str, list[int]] = {}
    for _ in range(4):
        delta = next(stream)
        tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert greedy_tokens(llm, PROMPTS[:2]) == fresh[:2]
    for delta in stream:
        tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert in_prompt_order(tokens) == fresh
    assert_nothing_left(llm)


def test_an_interrupt_while_another_stream_is_open_ends_that_stream_too(llm, fresh):
    open_stream = llm.stream(PROMPTS[:2], GREEDY)
    next(open_stream)
    with contextlib.suppress(KeyboardInterrupt), InterruptAfter(0.0):
        while True:  # until the interrupt lands
            greedy_tokens(llm)
    finals = [o for o in open_stream if o.finished]
    assert len(finals) == 2  # each ends, aborted, or finished before the interrupt landed
    assert_nothing_left(llm)
    assert greedy_tokens(llm) == fresh
