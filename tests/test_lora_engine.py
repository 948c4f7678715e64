"""LoRA in the engine: vLLM's ``lora_request`` API, adapters checked per request, the scheduler's
``max_loras`` rule (never starving a request), and prefix caching per adapter.

The scheduler tests drive a ``Scheduler`` with a fake runner (every request
samples token 7 once its prefill is done); the engine tests run a tiny Llama
checkpoint with PEFT adapters saved by ``test_lora_model.save_adapters``.
"""

import contextlib
import json
import shutil

import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from hf_models import save_tiny_hf_model
from runner_driver import tiny_llm
from test_cli import SMALL_ENGINE, _user_error, no_model_loads  # noqa: F401  (no_model_loads: a fixture)
from test_lora_model import save_adapters

from jaxrunner import cli
from jaxrunner.config import SchedulerConfig
from jaxrunner.engine.kv_cache_manager import KVCacheManager
from jaxrunner.engine.llm import LLM
from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.interfaces import ModelRunnerOutput, SamplingParams, SchedulerOutput
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models import TransformerConfig
from jaxrunner.models.random_lora import save_random_lora_adapter
from jaxrunner.models.tokenizer import build_byte_tokenizer

ADAPTERS = [LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abcde")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# ------------------------------------------------------------------ scheduler


def _request(req_id: str, lora: LoRARequest | None, prompt: list[int] | None = None, max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, prompt or [3, 4, 5, 6, 7], params, eos_token_id=None, lora_request=lora)


def _scheduler(max_loras: int, *, max_num_seqs: int = 8, num_blocks: int = 64, block_size: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len=64, max_loras=max_loras)


def _step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with a fake runner: each request whose prefill is done samples token 7."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_output_placeholders else [] for r in req_ids]
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled))
    return output


def _adapters_of(scheduler: Scheduler, output: SchedulerOutput, requests: dict[str, Request]) -> set[int]:
    return {requests[r].lora_int_id for r in output.num_scheduled_tokens} - {0}


def test_a_step_uses_at_most_max_loras_adapters_and_every_request_finishes():
    scheduler = _scheduler(max_loras=2)
    # Five adapters and the base model, interleaved: a, b, c, d, e, base, a, b, ...
    requests = {f"r{i}": _request(f"r{i}", ([*ADAPTERS, None])[i % 6]) for i in range(24)}
    for request in requests.values():
        scheduler.add_request(request)
    first_steps: dict[str, int] = {}
    for step in range(60):
        output = _step(scheduler)
        assert len(_adapters_of(scheduler, output, requests)) <= 2
        assert len({r.lora_int_id for r in scheduler.running} - {0}) <= 2  # the runner's slots
        for new in output.scheduled_new_reqs:
            assert new.lora_request == requests[new.req_id].lora_request
            first_steps.setdefault(new.req_id, step)
        if not scheduler.has_unfinished_requests():
            break
    assert all(r.is_finished for r in requests.values())
    # Base-model requests never wait for a slot: each starts in the first step it could.
    assert first_steps["r5"] == 0


def test_a_request_waiting_for_a_slot_is_never_starved():
    """vLLM's rule alone lets a stream of requests of a running adapter overtake it forever."""
    scheduler = _scheduler(max_loras=1)
    scheduler.add_request(_request("a0", ADAPTERS[0]))
    scheduler.add_request(waiting := _request("b", ADAPTERS[1]))
    for step in range(40):  # a new request of adapter a arrives every step
        scheduler.add_request(_request(f"a{step + 1}", ADAPTERS[0]))
        _step(scheduler)
        if waiting.is_finished:
            break
    assert waiting.is_finished and step < 10, step


def test_a_preempted_request_resumes_with_its_adapter():
    scheduler = _scheduler(max_loras=2, num_blocks=8, block_size=2)  # 7 blocks: too few for 4 long requests
    requests = [_request(f"r{i}", ADAPTERS[i % 2], prompt=list(range(3, 9)), max_tokens=6) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    resumed = []
    while scheduler.has_unfinished_requests():
        output = _step(scheduler)
        resumed += [new for new in output.scheduled_new_reqs if len(new.prefill_token_ids or []) > 6]
    assert scheduler.num_preemptions > 0 and resumed
    for new in resumed:
        assert new.lora_request == ADAPTERS[int(new.req_id[1:]) % 2]


def test_prefix_blocks_are_shared_within_an_adapter_and_never_across():
    manager = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(3, 16))  # three full blocks and a token
    assert manager.allocate_slots("a", prompt, len(prompt), 0, extra_key="a") == ([1, 2, 3, 4],)
    assert manager.get_computed_blocks("a2", prompt, "a") == (([1, 2, 3],), 12)
    assert manager.get_computed_blocks("b", prompt, "b") == (([],), 0)
    assert manager.get_computed_blocks("base", prompt) == (([],), 0)
    # The scheduler keys each request's blocks on its adapter's name.
    scheduler = _scheduler(max_loras=2)
    computed = {}
    for req_id, lora in [("a", ADAPTERS[0]), ("b", ADAPTERS[1]), ("base", None), ("a2", ADAPTERS[0])]:
        scheduler.add_request(_request(req_id, lora, prompt=prompt))
        (new,) = _step(scheduler).scheduled_new_reqs
        computed[req_id] = new.num_computed_tokens
    assert computed == {"a": 0, "b": 0, "base": 0, "a2": 12}


# --------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, dict[str, LoRARequest]]:
    """A tiny Llama checkpoint's directory (the byte tokenizer's vocabulary); its two PEFT adapters and
    adapters wrong in each way the engine must refuse, as LoRARequests by name."""
    root = tmp_path_factory.mktemp("lora_engine")
    tokenizer = build_byte_tokenizer()
    save_tiny_hf_model("llama", root / "base", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(root / "base")
    paths = save_adapters(root / "base", root)
    arch = TransformerConfig.from_hf(transformers.AutoConfig.from_pretrained(root / "base"))
    paths["random-r4"] = str(
        save_random_lora_adapter(root / "random-r4", arch, rank=4, target_modules=["o_proj", "up_proj"], b_std=0.1)
    )
    good = paths["all-r8"]

    def broken(name: str, config_changes: dict, shrink: str | None = None) -> str:
        path = root / name
        shutil.copytree(good, path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(config | config_changes))
        if shrink is not None:  # one factor cut short, as if trained for another base model
            tensors = safetensors.numpy.load_file(path / "adapter_model.safetensors")
            tensors[shrink] = np.ascontiguousarray(tensors[shrink][:, :-8])
            safetensors.numpy.save_file(tensors, path / "adapter_model.safetensors")
        return str(path)

    paths |= {
        "missing": str(root / "nowhere"),
        "rank-64": broken("rank-64", {"r": 64}),
        "lm-head": broken("lm-head", {"target_modules": ["q_proj", "lm_head"]}),
        "narrow": broken("narrow", {}, shrink="base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"),
    }
    return str(root / "base"), {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


@pytest.fixture(scope="module")
def adapters(checkpoints) -> dict[str, LoRARequest]:
    return checkpoints[1]


@pytest.fixture(scope="module")
def llm(checkpoints, cache_dir) -> LLM:
    base_dir, _ = checkpoints
    return tiny_llm(cache_dir, base_dir, enable_lora=True, max_loras=2, max_lora_rank=16)


def _all_blocks_free(llm: LLM) -> bool:
    manager = llm.kv_cache_manager
    return not llm.replicas.has_unfinished_requests() and manager.num_free_blocks == manager.num_usable_blocks


def test_lora_request_forms_are_refused_before_any_prompt_is_queued(llm, adapters):
    one = adapters["all-r8"]
    cases = [
        ([one], "Got 1 LoRA requests for 2 prompts"),
        ([one, "all-r8"], r"lora_request\[1\] must be a LoRARequest .* got str"),
        ({"name": "all-r8"}, "lora_request must be a LoRARequest .* got dict"),
    ]
    for lora_request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=False, lora_request=lora_request)
        with pytest.raises(ValueError, match=message):
            llm.stream([[5, 6], [7, 8]], GREEDY, lora_request=lora_request)
    assert _all_blocks_free(llm)


def test_a_bad_adapter_is_refused_by_name_while_the_other_prompts_finish(llm, adapters):
    bad = {
        "missing": "is not a directory",
        "rank-64": "has rank 64, above max_lora_rank 16",
        "lm-head": "targets ['lm_head']",
        "narrow": "lora_A of model.layers.1.mlp.up_proj of shape (8, 120)",
    }
    loras = [adapters[name] for name in bad] + [None]
    outputs = llm.generate([[5, 6, 7]] * len(loras), GREEDY, use_tqdm=False, lora_request=loras)
    for output, (name, why) in zip(outputs, bad.items()):
        assert output.error is not None and output.lora_request == adapters[name]
        assert f"LoRA adapter {name!r}" in output.error and why in output.error, output.error
    assert outputs[-1].error is None and len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
    assert _all_blocks_free(llm)


def test_an_adapter_id_or_name_names_one_adapter(llm, adapters):
    good = adapters["all-r8"]
    assert llm.llm_engine.add_lora(good)
    other_name = LoRARequest("renamed", good.lora_int_id, good.lora_path)
    other_id = LoRARequest(good.lora_name, 50, adapters["some-r16-rs"].lora_path)
    outputs = llm.generate([[5, 6, 7]] * 2, GREEDY, use_tqdm=False, lora_request=[other_name, other_id])
    assert f"lora_int_id {good.lora_int_id} already names adapter 'all-r8'" in (outputs[0].error or "")
    assert "the name 'all-r8' already names lora_int_id" in (outputs[1].error or "")
    assert _all_blocks_free(llm)


def peft_greedy(base_dir: str, prompts: list[list[int]], loras: list[LoRARequest | None], num_tokens: int):
    """PEFT's greedy ``generate`` of each prompt under its adapter (None: adapters disabled)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    named = {lora.lora_name: lora.lora_path for lora in loras if lora is not None}
    first, *others = named
    model = peft.PeftModel.from_pretrained(base, named[first], adapter_name=first)
    for name in others:
        model.load_adapter(named[name], adapter_name=name)
    model.eval()
    tokens = []
    for prompt, lora in zip(prompts, loras, strict=True):
        with torch.no_grad(), model.disable_adapter() if lora is None else contextlib.nullcontext():
            if lora is not None:
                model.set_adapter(lora.lora_name)
            out = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
            )
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def test_greedy_tokens_of_a_batch_mixing_adapters_match_peft(checkpoints, cache_dir, monkeypatch):
    """Three adapters and the base model in one batch, two adapter slots: prompts longer than a step's
    tokens (chunked prefill), a cache too small for every prompt at once (preemption, some mid-decode),
    and prompts sharing a prefix under one adapter (prefix caching) and across adapters (no sharing)."""
    base_dir, adapters = checkpoints
    llm = tiny_llm(cache_dir, base_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_gpu_blocks_override=10)
    scheduler = llm.llm_engine.scheduler
    resumed = []  # requests with an adapter, scheduled again after a preemption that followed a sample

    def schedule(schedule=scheduler.schedule) -> SchedulerOutput:
        output = schedule()
        for new in output.scheduled_new_reqs:
            if new.lora_request is not None and len(new.prefill_token_ids or ()) > len(new.prompt_token_ids):
                resumed.append(new.req_id)
        return output

    monkeypatch.setattr(scheduler, "schedule", schedule)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 250, 40).tolist()
    prompts = [shared + rng.integers(3, 250, n).tolist() for n in (30, 5, 52, 17, 9, 41, 23, 12)]
    names = ["all-r8", None, "some-r16-rs", "random-r4", "all-r8", "random-r4", None, "some-r16-rs"]
    loras = [None if name is None else adapters[name] for name in names]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outputs] == peft_greedy(base_dir, prompts, loras, 16)
    assert [o.lora_request for o in outputs] == loras
    assert resumed and llm.kv_cache_manager.stats.hits > 0
    assert _all_blocks_free(llm)


def test_multi_step_rounds_keep_each_request_on_its_adapter(checkpoints, cache_dir, monkeypatch):
    """Rounds of several decode steps in one program (``num_scheduler_steps``) over a batch mixing two
    adapters and the base model give PEFT's greedy tokens: each round's steps keep every token on its
    request's adapter."""
    base_dir, adapters = checkpoints
    llm = tiny_llm(cache_dir, base_dir, enable_lora=True, max_loras=2, max_lora_rank=16, num_scheduler_steps=4)
    runner = llm.llm_engine.runner
    steps_per_round = []
    execute = runner.execute_model

    def record(scheduler_output):
        if scheduler_output.total_num_scheduled_tokens:
            steps_per_round.append(scheduler_output.num_decode_steps)
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", record)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, n).tolist() for n in (9, 14, 6, 11)]
    loras = [adapters["all-r8"], None, adapters["random-r4"], adapters["all-r8"]]
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert max(steps_per_round) == 4, steps_per_round
    assert [o.outputs[0].token_ids for o in outputs] == peft_greedy(base_dir, prompts, loras, 13)
    assert _all_blocks_free(llm)


# ------------------------------------------------------------------------ CLI


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora", "a=/adapters/a"], "--lora needs --enable-lora"),
        (["--enable-lora", "--lora", "a=/adapters/a", "--lora", "a=/adapters/b"], "--lora names ['a'] more than once"),
        (["--enable-lora", "--lora", "/adapters/a"], "argument --lora: must be NAME=PATH"),
    ],
)
@pytest.mark.usefixtures("no_model_loads")
def test_lora_flags_are_refused_before_the_model_loads(capsys, flags, message):
    assert message in _user_error(capsys, ["generate", *flags])


def test_lora_settings_and_adapters_the_engine_refuses_are_one_line(capsys, tmp_path):
    assert "LoRAConfig.max_loras must be positive; got 0" in _user_error(
        capsys, ["bench", "--enable-lora", "--max-loras=0", *SMALL_ENGINE]
    )
    error = _user_error(capsys, ["generate", "--enable-lora", f"--lora=gone={tmp_path / 'gone'}", *SMALL_ENGINE])
    assert f"LoRA adapter 'gone' at {tmp_path / 'gone'}: is not a directory" in error


def test_cli_runs_the_requests_over_the_lora_adapters_in_turn(checkpoints, capsys, tmp_path):
    base_dir, adapters = checkpoints
    flags = [f"--model={base_dir}", "--enable-lora", "--max-loras=2", *SMALL_ENGINE]
    flags += [f"--lora={name}={adapters[name].lora_path}" for name in ("all-r8", "random-r4")]
    cli.main(["generate", "--max-tokens=4", "--prompt=Hi", "--prompt=Ho", "--prompt=Ha", *flags])
    out = capsys.readouterr().out
    for prompt, name in [("Hi", "all-r8"), ("Ho", "random-r4"), ("Ha", "all-r8")]:
        assert f"'{prompt}' [LoRA {name}] -> " in out
    result_path = tmp_path / "bench.json"
    cli.main(
        [
            "bench",
            "--num-prompts=4",
            "--input-len=8",
            "--output-len=4",
            "--quiet",
            f"--output-json={result_path}",
            *flags,
        ]
    )
    result = json.loads(result_path.read_text())
    assert result["lora_adapters"] == ["all-r8", "random-r4"] and result["output_tokens_per_s"] > 0
