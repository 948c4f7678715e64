"""The engine through ``LLM``: scheduling invariants, stop conditions, bad input, HF parity."""

import dataclasses
import json
from collections.abc import Sequence

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_models import save_tiny_hf_model

from jaxrunner.cli import main as cli_main
from jaxrunner.engine.llm import LLM
from jaxrunner.engine.llm_engine import StepWork, _step_work
from jaxrunner.interfaces import CachedRequestData, SamplingParams, SchedulerOutput
from jaxrunner.models.tokenizer import build_byte_tokenizer
from jaxrunner.roofline import step_costs, step_floor_s

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LADDERS = dict(token_buckets=[8, 32, 64], request_buckets=[2, 8])


@pytest.fixture
def make_llm(cache_dir):
    """LLMs on the built-in tiny model; after the test every KV block must be free again."""
    made = []

    def make(**overrides):
        kwargs = dict(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_gpu_blocks_override=200,
            compilation_cache_dir=cache_dir,
            **LADDERS,
        )
        llm = LLM("tiny-llama", **{**kwargs, **overrides})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        manager = llm.kv_cache_manager
        assert not llm.llm_engine.has_unfinished_requests()
        assert manager.num_free_blocks == manager.num_usable_blocks, "KV blocks leaked"


def token_prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


def greedy_tokens(llm, prompts, params: SamplingParams | Sequence[SamplingParams] = GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = token_prompts(0, [5, 70, 33, 16, 1, 48, 90, 12, 27, 64])


def test_greedy_outputs_identical_across_caching_chunking_and_preemption(make_llm):
    # One step at a time; every other engine here schedules asynchronously.
    baseline = greedy_tokens(make_llm(enable_prefix_caching=False, async_scheduling=False), PROMPTS)
    assert greedy_tokens(make_llm(), PROMPTS + PROMPTS[:3])[: len(PROMPTS)] == baseline
    # No chunking: the budget must hold the longest prompt whole.
    unchunked = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=128, token_buckets=[8, 32, 64, 128])
    assert greedy_tokens(unchunked, PROMPTS) == baseline
    # A cache far too small for the batch forces preemption by recompute.
    tight = make_llm(num_gpu_blocks_override=14, enable_prefix_caching=False)
    assert greedy_tokens(tight, PROMPTS) == baseline
    assert tight.llm_engine.scheduler.num_preemptions > 0


def _dispatch_order(llm, monkeypatch) -> list[str]:
    """Records "D" when the runner dispatches a step and "R" when a step's tokens are read."""
    from jaxrunner.runner.async_output import AsyncOutput

    events = []
    runner = llm.llm_engine.runner
    execute = runner.execute_model
    get_output = AsyncOutput.get_output

    def dispatch(scheduler_output):
        if scheduler_output.total_num_scheduled_tokens:
            events.append("D")
        return execute(scheduler_output)

    def read(self):
        events.append("R")
        return get_output(self)

    monkeypatch.setattr(runner, "execute_model", dispatch)
    monkeypatch.setattr(AsyncOutput, "get_output", read)
    return events


def test_async_scheduling_overlaps_steps_and_changes_no_output(make_llm, monkeypatch):
    """Step k+1 is dispatched before step k's tokens are read, and the outputs (seeded sampling,
    stop token ids, max_tokens, preemption) equal those of the engine that runs one step at a time."""
    prompts = PROMPTS[:8]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(8)]
    sync = make_llm(async_scheduling=False, num_gpu_blocks_override=16)
    sync_events = _dispatch_order(sync, monkeypatch)
    expected = [o.outputs[0] for o in sync.generate(prompts, sampled, use_tqdm=False)]
    assert "DD" not in "".join(sync_events)
    # A token that some request samples third: as a stop token id it ends requests early.
    stop = next(c.token_ids[2] for c in expected if len(c.token_ids) > 3)
    stopping = [dataclasses.replace(p, stop_token_ids=[stop]) for p in sampled]
    expected_stopped = [o.outputs[0] for o in sync.generate(prompts, stopping, use_tqdm=False)]

    overlapped = make_llm(num_gpu_blocks_override=16)
    events = _dispatch_order(overlapped, monkeypatch)
    got = [o.outputs[0] for o in overlapped.generate(prompts, sampled, use_tqdm=False)]
    got_stopped = [o.outputs[0] for o in overlapped.generate(prompts, stopping, use_tqdm=False)]
    assert "DDR" in "".join(events)
    for want, have in zip(expected + expected_stopped, got + got_stopped):
        assert (have.token_ids, have.finish_reason, have.stop_reason) == (
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
    assert any(c.finish_reason == "stop" for c in got_stopped)
    assert overlapped.llm_engine.scheduler.num_preemptions > 0
    assert [len(c.token_ids) for c in got] == [p.max_tokens for p in sampled]


def test_multi_step_rounds_change_no_output(make_llm, monkeypatch):
    """Several decode steps per round (``num_scheduler_steps``) give the tokens of one step at a time:
    seeded sampling, lengths that end mid-round, requests waiting for a slot, a cache tight enough to
    preempt (between rounds: a round starts only when the free blocks hold it); and a request that can
    stop early (a stop token id) or samples with a stage before the draw keeps the whole batch to
    single steps while it runs."""
    prompts = PROMPTS[:10]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(10)]
    mixed = [
        dataclasses.replace(sampled[0], stop_token_ids=[0]),
        dataclasses.replace(sampled[1], top_k=5),
        *sampled[2:],
    ]
    single = make_llm(num_gpu_blocks_override=24)
    expected = [greedy_tokens(single, prompts, params) for params in (sampled, mixed)]

    for blocks in (200, 24):  # 24: too few blocks for all ten, so requests get preempted
        multi = make_llm(num_scheduler_steps=4, num_gpu_blocks_override=blocks)
        engine = multi.llm_engine
        rounds = []  # per dispatched round: its steps, and whether all its requests may take several
        execute = engine.runner.execute_model

        def record(so, engine=engine, rounds=rounds, execute=execute):
            if so.total_num_scheduled_tokens:
                eligible = all(engine.scheduler.requests[r].multi_step_ok for r in so.num_scheduled_tokens)
                rounds.append((so.num_decode_steps, eligible))
            return execute(so)

        monkeypatch.setattr(engine.runner, "execute_model", record)
        assert greedy_tokens(multi, prompts, sampled) == expected[0]
        assert {2, 4} <= {steps for steps, _ in rounds}, rounds
        rounds.clear()
        assert greedy_tokens(multi, prompts, mixed) == expected[1]
        assert max(rounds)[0] > 1 and all(eligible for steps, eligible in rounds if steps > 1)
        assert not all(eligible for _, eligible in rounds)
    assert multi.llm_engine.scheduler.num_preemptions > 0


def test_a_request_id_reused_after_a_stop_gets_none_of_the_old_tokens(make_llm):
    """A request stopped by a token id while its next step was in flight: the engine settles that
    step before it goes idle, so a later request with the same id starts clean."""
    engine = make_llm().llm_engine
    prompt = PROMPTS[1]
    first = greedy_tokens(make_llm(async_scheduling=False), [prompt])[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first[2]])
    runs = []
    for _ in range(2):
        engine.add_request("a", prompt, params)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        runs.append(done[0].outputs[0].token_ids)
    assert runs[0] == runs[1] == first[:3]


def test_prefix_caching_hits_and_computes_fewer_tokens(make_llm):
    shared = token_prompts(1, [64])[0]
    prompts = [shared + tail for tail in token_prompts(2, [5, 9, 3, 7])]
    computed = {}
    for caching in (False, True):
        llm = make_llm(enable_prefix_caching=caching)
        scheduler = llm.llm_engine.scheduler
        for prompt in prompts:  # one at a time, so later prompts find the shared blocks
            llm.generate([prompt], GREEDY, use_tqdm=False)
        computed[caching] = scheduler.num_scheduled_tokens_total
        if caching:
            assert llm.kv_cache_manager.stats.hits >= 3 * 64
    assert computed[True] <= computed[False] - 3 * 64


def test_generate_matches_transformers_greedy_text(tmp_path, cache_dir):
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("llama", tmp_path, seed=4, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    texts = ["Hello there", "JAX on GPUs is fast", "a"]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=64,
        compilation_cache_dir=cache_dir,
        token_buckets=[8, 64],
        request_buckets=[4],
    )
    ours = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for text, output in zip(texts, ours):
        ids = tokenizer.encode(text)
        with torch.no_grad():
            # transformers types GenerationMixin's self as a Protocol (written for `ty`) that pyright finds
            # PreTrainedModel does not satisfy (hf_quantizer is declared, not set on the class).
            ref = hf.generate(  # pyright: ignore[reportAttributeAccessIssue]
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )
        ref_ids = ref[0, len(ids) :].tolist()
        assert output.outputs[0].token_ids == ref_ids
        assert output.outputs[0].text == tokenizer.decode(ref_ids, skip_special_tokens=True)


def test_bad_requests_get_errors_while_the_rest_complete(make_llm):
    llm = make_llm(max_model_len=128)
    bad_params = SamplingParams(temperature=0.0)
    bad_params.top_p = 7.0  # changed after construction: caught when the request is added
    never = SamplingParams(temperature=0.0, max_tokens=6, stop=["\x00never-there\x00"], ignore_eos=True)
    prompts = [PROMPTS[0], list(range(3, 200)), [], PROMPTS[1], PROMPTS[2], "plain text"]
    params = [GREEDY, GREEDY, GREEDY, bad_params, never, GREEDY]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, False, False, True, True]
    assert "max_model_len" in outputs[1].error
    assert "empty" in outputs[2].error
    assert "SamplingParams.top_p" in outputs[3].error
    assert outputs[4].outputs[0].finish_reason == "length" and len(outputs[4].outputs[0].token_ids) == 6
    for good in (outputs[0], outputs[5]):
        assert good.finished and len(good.outputs[0].token_ids) == 12


def test_requests_that_could_never_run_are_refused(make_llm):
    unchunked = make_llm(enable_chunked_prefill=False)
    out = unchunked.generate([list(range(3, 100)), PROMPTS[0]], GREEDY, use_tqdm=False)
    assert "max_num_batched_tokens" in out[0].error and out[1].error is None
    small = make_llm(num_gpu_blocks_override=5)  # 4 usable blocks: 64 tokens
    out = small.generate([list(range(3, 80)), PROMPTS[0]], GREEDY, use_tqdm=False)
    assert "KV cache blocks" in out[0].error and len(out[1].outputs[0].token_ids) == 12


def test_stop_strings_tokens_and_lengths(make_llm):
    llm = make_llm()
    prompt = "Once upon a time"
    free_run = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop = free_run.text[5:8]
    stopped = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free_run.text[: free_run.text.index(stop)]
    stop_id = free_run.token_ids[4]
    by_token = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    first = free_run.token_ids.index(stop_id)
    assert by_token.token_ids == free_run.token_ids[: first + 1] and by_token.stop_reason == stop_id
    # min_tokens defers the stop token id.
    deferred = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=first + 2, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(deferred.token_ids) > first + 1


def test_n_samples_share_the_prompt_and_stream_deltas_add_up(make_llm):
    llm = make_llm()
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    prompt = token_prompts(3, [40])[0]
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert llm.kv_cache_manager.stats.hits >= 2 * 32  # children reuse the prompt's full blocks
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]

    text_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    whole = llm.generate(["stream me", "and me"], text_params, use_tqdm=False)
    pieces: dict[str, list[str]] = {}
    for delta in llm.stream(["stream me", "and me"], text_params):
        pieces.setdefault(delta.prompt, []).append(delta.outputs[0].text)
    for output in whole:
        assert "".join(pieces[output.prompt]) == output.outputs[0].text
        assert output.metrics.time_to_first_token > 0 and output.metrics.time_per_output_token > 0


def test_chat_uses_the_template(make_llm):
    llm = make_llm()
    reply = llm.chat(
        [{"role": "user", "content": "Hi!"}],
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    expected = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=True, add_generation_prompt=True
    )
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert reply[0].prompt_token_ids == expected and len(reply[0].outputs[0].token_ids) == 5


def test_cli_generate_and_bench(tmp_path, capsys, cache_dir, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cli_main(["generate", "--prompt", "Hi", "--max-tokens", "8", "--num-gpu-blocks-override", "64"])
    out = capsys.readouterr().out
    assert "'Hi' ->" in out and "tokens/s" in out
    result_path = tmp_path / "bench.json"
    cli_main(
        [
            "bench",
            "--num-prompts",
            "6",
            "--input-len",
            "20",
            "--output-len",
            "6",
            "--range-ratio",
            "0.5",
            "--num-gpu-blocks-override",
            "64",
            "--quiet",
            "--output-json",
            str(result_path),
        ]
    )
    result = json.loads(result_path.read_text())
    assert result["num_prompts"] == 6 and result["output_tokens_per_s"] > 0
    assert set(result["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
    # One step prefills every prompt (111 tokens); every token after the first (3 to 9 a request) takes a
    # decode-only step. The first of them waits for the prefill step, so it is not counted as one.
    assert result["decode_steps"] == 7
    assert 0 < result["decode_host_ms_per_step"] < result["decode_step_ms"]
    assert result["decode_step_ms"] < 1.5 * result["tpot_ms"]["p50"]  # counting it would double the mean here
    # The bound: the weights and KV tokens every step reads, at the copy rate measured in the run.
    assert result["copy_bytes_per_s"] > 0 and result["bound_s"] > 0
    assert result["bound_fraction"] == pytest.approx(result["bound_s"] / result["elapsed_s"])
    # The roofline takes each step at the slower of its bytes and its FLOPs: never below the bytes alone.
    assert result["matmul_flops_per_s"] > 0 and result["roofline_bound_s"] >= result["bound_s"]
    assert result["roofline_bound_fraction"] == pytest.approx(result["roofline_bound_s"] / result["elapsed_s"])
    assert result["memory_budget"]["kv_cache_blocks"] == 64 and result["memory_budget"]["total_gib"] is None
    out = capsys.readouterr().out
    assert "req/s" in out and "bound: reading the weights and KV tokens" in out and "memory: KV cache 64" in out


def test_cli_passes_the_kv_cache_dtype_to_the_engine(monkeypatch):
    class Built(Exception):
        """Raised in place of building the engine, with the keyword arguments it was given."""

    def llm(model, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr("jaxrunner.engine.llm.LLM", llm)
    flags = "--num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs 512 --kv-cache-dtype fp8"
    with pytest.raises(Built) as built:
        cli_main(["bench", *flags.split()])
    assert built.value.args[0]["kv_cache_dtype"] == "fp8" and built.value.args[0]["max_num_seqs"] == 512


def test_step_times_count_what_every_forward_pass_reads_and_scores(make_llm):
    prompts, params = [[5] * 10, [6] * 20], SamplingParams(max_tokens=5, ignore_eos=True)
    for steps in (1, 4):
        llm = make_llm(async_scheduling=False, enable_prefix_caching=False, num_scheduler_steps=steps)
        times = llm.llm_engine.step_times
        times.work = []
        llm.generate(prompts, params, use_tqdm=False)
        # The prefill pass reads 10 + 20 tokens, the four decode passes one more each a pass, however grouped.
        assert (times.forward_passes, times.kv_tokens_read) == (5, 30 + 32 + 34 + 36 + 38)
        # It scores 10 * 11 / 2 + 20 * 21 / 2 pairs, the decodes (11 + ... + 14) + (21 + ... + 24).
        assert sum(w.attention_pairs for w in times.work) == 55 + 210 + 50 + 90
        assert sum(w.tokens for w in times.work) == 30 + 2 * 4 and sum(w.forward_passes for w in times.work) == 5
    # A round of 4 decode steps over contexts of 10 and 20: (11 + 21) + (12 + 22) + (13 + 23) + (14 + 24).
    cached = CachedRequestData(req_ids=["a", "b"], num_computed_tokens=[10, 20], new_block_ids=[None, None])
    round_of_4 = _step_work(SchedulerOutput([], cached, {"a": 4, "b": 4}, 8, num_decode_steps=4))
    assert (round_of_4.kv_tokens_read, round_of_4.attention_pairs) == (32 + 34 + 36 + 38, 50 + 90)


def test_a_steps_floor_is_its_bytes_or_its_flops_whichever_is_slower(make_llm):
    runner = make_llm().llm_engine.runner
    costs = step_costs(runner)
    # The tiny Llama: 2 layers of q/k/v 128 x (128 + 64 + 64), o 128 x 128, gate/up 128 x 512, down 256 x 128;
    # the embedding table and LM head not counted. Scoring a pair: 2 x 2 FLOPs a head dimension, 4 heads of 32.
    assert costs.matmul_params == 2 * (128 * 256 + 128 * 128 + 128 * 512 + 256 * 128)
    assert costs.flops_per_pair == 4 * 2 * 4 * 32
    assert costs.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32, float32
    assert costs.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(runner.params))
    decode, prefill = StepWork(1, 8, 8 * 100, 8 * 100), StepWork(1, 2048, 2048, 2048 * 2049 // 2)
    copy, flops = 1e12, 1e14
    assert step_floor_s(decode, costs, copy, flops) == pytest.approx(
        (costs.weight_bytes + 800 * costs.kv_bytes_per_token) / copy
    )
    assert step_floor_s(prefill, costs, copy, flops) == pytest.approx(
        (2 * 2048 * costs.matmul_params + 2048 * 2049 // 2 * costs.flops_per_pair) / flops
    )
