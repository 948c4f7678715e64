"""The runner with LoRA adapters against PEFT's ``generate``: adapters and the base model mixed in one
batch, more adapters than slots over a run, no compile after warm-up, the slot table, and refusals."""

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import peft
import pytest
import torch
import transformers
from hf_models import save_tiny_hf_model
from runner_driver import HandScheduler, make_runner
from test_lora_model import save_adapters

from jaxrunner.config import LoRAConfig, ParallelConfig, RunnerConfig, SpeculativeConfig
from jaxrunner.interfaces import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from jaxrunner.lora import LoRARequest
from jaxrunner.models import load_model
from jaxrunner.models.lora_adapter import LoRAAdapterError
from jaxrunner.runner.compilation import CompileCounter
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.runner.step_recovery import reset_runner

GREEDY = SamplingParams(temperature=0.0)
NUM_TOKENS = 12
PROMPTS = [[(7 * i + 3 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate((5, 37, 17, 16, 9, 23))]
TOKEN_BUCKETS, REQUEST_BUCKETS = [8, 16, 32], [1, 2, 4]


class Checkpoints:
    """The tiny base checkpoint, two PEFT adapters on it, and PEFT's greedy tokens per (adapter, prompt)."""

    def __init__(self, root):
        self.base_dir = root / "base"
        save_tiny_hf_model("llama", self.base_dir)
        self.adapter_paths = save_adapters(self.base_dir, root)
        names = list(self.adapter_paths)
        self.requests = {
            name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(self.adapter_paths.items())
        }
        base = transformers.AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        self.peft = peft.PeftModel.from_pretrained(base, self.adapter_paths[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.peft.load_adapter(self.adapter_paths[name], adapter_name=name)
        self.peft.eval()
        self._greedy: dict[tuple[str | None, int], list[int]] = {}

    def greedy(self, adapter: str | None, prompt: int) -> list[int]:
        """PEFT's float32 greedy tokens of ``PROMPTS[prompt]`` under ``adapter`` (None: the base model)."""
        if (adapter, prompt) not in self._greedy:
            self._greedy[adapter, prompt] = self._generate(adapter, prompt)
        return self._greedy[adapter, prompt]

    def _generate(self, adapter: str | None, prompt: int) -> list[int]:
        ids = torch.tensor([PROMPTS[prompt]])
        generate = lambda: self.peft.generate(
            input_ids=ids, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False
        )
        with torch.no_grad():
            if adapter is None:
                with self.peft.disable_adapter():
                    out = generate()
            else:
                self.peft.set_adapter(adapter)
                out = generate()
        return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    CompileCounter.install()
    return Checkpoints(tmp_path_factory.mktemp("lora_runner"))


def _runner(checkpoints: Checkpoints, cache_dir: str, **lora) -> ModelRunner:
    model, _ = load_model(checkpoints.base_dir, dtype="float32")
    return make_runner(
        model,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        cache_dir=cache_dir,
        lora_config=LoRAConfig(**lora),
        token_buckets=TOKEN_BUCKETS,
        request_buckets=REQUEST_BUCKETS,
    )


def _run_and_check(checkpoints: Checkpoints, scheduler: HandScheduler, adapters: list[str | None]) -> None:
    """Run one request per adapter of ``adapters`` (prompt i for the i-th) to the end, against PEFT."""
    for i, name in enumerate(adapters):
        lora_request = None if name is None else checkpoints.requests[name]
        scheduler.add(f"r{i}", PROMPTS[i], GREEDY, NUM_TOKENS, lora_request)
    ours = scheduler.run()
    for i, name in enumerate(adapters):
        assert ours[f"r{i}"] == checkpoints.greedy(name, i), f"request {i}, adapter {name}"


def test_adapters_and_the_base_model_in_one_batch_match_peft_generate(checkpoints, cache_dir):
    """Two adapters and the base model share every step (chunked prefill mixed with decodes)."""
    runner = _runner(checkpoints, cache_dir, max_loras=2, max_lora_rank=16)
    runner.capture_model()
    compiled, programs = CompileCounter.count(), runner.num_compiled_programs
    scheduler = HandScheduler(runner, token_budget=24, max_chunk=13, seed=1)
    _run_and_check(checkpoints, scheduler, ["all-r8", None, "some-r16-rs", "all-r8"])
    assert CompileCounter.count() == compiled and runner.num_compiled_programs == programs
    assert runner.spans.counts["load_lora"] == 2
    assert runner.lora is not None and runner.lora.num_unused_slots == 2  # every slot free at the end
    assert sorted(scheduler.free_blocks) == list(range(runner.num_blocks))


def test_more_adapters_than_slots_all_finish_correct_and_compile_nothing(checkpoints, cache_dir):
    """One slot, one adapter kept on the host: the requests of the second adapter wait for the first's
    to finish, and each change of adapter reads and loads it again; the base model's requests run beside
    either. A reset (a step cut short) keeps the slot's adapter, so its next request loads nothing."""
    runner = _runner(checkpoints, cache_dir, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    runner.capture_model()
    compiled, programs = CompileCounter.count(), runner.num_compiled_programs
    loads = lambda: runner.spans.counts["load_lora"]
    schedule = lambda: HandScheduler(runner, token_budget=24, max_chunk=13, seed=2, max_loras=1)
    _run_and_check(checkpoints, schedule(), ["all-r8", "some-r16-rs", None, "all-r8", "some-r16-rs"])
    assert loads() == 2
    _run_and_check(checkpoints, schedule(), ["all-r8", None])  # arriving after the others finished
    assert loads() == 3
    assert CompileCounter.count() == compiled and runner.num_compiled_programs == programs
    reset_runner(runner)  # makes a fresh device state (a compile of its own)
    compiled = CompileCounter.count()
    _run_and_check(checkpoints, schedule(), ["all-r8", "some-r16-rs", "all-r8"])
    assert loads() == 4
    assert CompileCounter.count() == compiled and runner.num_compiled_programs == programs
    assert runner.lora is not None and runner.lora.num_unused_slots == 1


def _step(
    new: Sequence[NewRequestData] = (),
    finished: AbstractSet[str] = frozenset(),
    preempted: AbstractSet[str] = frozenset(),
) -> SchedulerOutput:
    """A step that adds, finishes or preempts requests and schedules no token."""
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def _new(req_id: str, lora_request) -> NewRequestData:
    return NewRequestData(req_id, [1, 2, 3], GREEDY, ([],), 0, lora_request=lora_request)


def test_slot_table_reuses_unused_slots_least_recently_used_first(checkpoints, cache_dir):
    runner = _runner(checkpoints, cache_dir, max_loras=2, max_lora_rank=16)
    lora = runner.lora
    assert lora is not None
    a, b = checkpoints.requests.values()
    c = LoRARequest("all-r8-again", 3, a.lora_path)  # another adapter id, so another slot
    loads = lambda: runner.spans.counts["load_lora"]
    runner.execute_model(_step([_new("a1", a), _new("b1", b), _new("base", None)]))
    assert lora.loaded == {1: 0, 2: 1} and loads() == 2 and lora.num_unused_slots == 0
    runner.execute_model(_step([_new("a2", a)]))  # its adapter is in a slot already
    assert loads() == 2
    with pytest.raises(ValueError, match=r"all 2 LoRA slots hold adapters of running requests.*max_loras"):
        runner.execute_model(_step([_new("c1", c)]))
    runner.execute_model(_step(preempted={"b1"}))  # b's slot is unused now, its weights kept
    runner.execute_model(_step([_new("b2", b)]))
    assert loads() == 2 and lora.loaded == {1: 0, 2: 1}
    runner.execute_model(_step(finished={"b2"}))
    runner.execute_model(_step([_new("c2", c)]))  # takes b's slot, the only unused one
    assert loads() == 3 and lora.loaded == {1: 0, 3: 1}
    runner.execute_model(_step(finished={"a1", "a2"}))
    runner.execute_model(_step(finished={"c2"}))
    runner.execute_model(_step([_new("b3", b)]))  # a's slot was unused first
    assert loads() == 4 and lora.loaded == {2: 0, 3: 1}
    runner.execute_model(_step(finished={"b3", "base"}))
    assert lora.num_unused_slots == 2
    runner.execute_model(_step([_new("b4", b), _new("c3", c)]))
    reset_runner(runner)  # drops every request: every slot unused, each keeping its adapter
    assert lora.num_unused_slots == 2 and lora.loaded == {2: 0, 3: 1}
    runner.execute_model(_step([_new("c4", c)]))
    assert loads() == 4 and lora.num_unused_slots == 1


def test_bad_adapters_and_unsupported_configurations_are_refused(checkpoints, cache_dir, tmp_path):
    runner = _runner(checkpoints, cache_dir, max_loras=1, max_lora_rank=8)
    too_big = checkpoints.requests["some-r16-rs"]
    with pytest.raises(LoRAAdapterError, match="'some-r16-rs'.*above max_lora_rank 8"):
        runner.check_lora_request(too_big)
    missing = LoRARequest("missing", 5, str(tmp_path / "nowhere"))
    with pytest.raises(LoRAAdapterError, match="'missing'"):
        runner.execute_model(_step([_new("m", missing)]))
    with pytest.raises(TypeError, match="LoRARequest"):
        runner.execute_model(_step([_new("t", "all-r8")]))
    assert runner.lora is not None and runner.lora.loaded == {} and runner.lora.num_unused_slots == 1
    empty_prompt = NewRequestData("e", [], GREEDY, ([],), 0, lora_request=checkpoints.requests["all-r8"])
    with pytest.raises(ValueError, match="empty prompt"):  # refused after its adapter was loaded
        runner.execute_model(_step([empty_prompt]))
    assert runner.lora.loaded == {1: 0} and runner.lora.num_unused_slots == 1  # loaded, used by no request

    model, _ = load_model(checkpoints.base_dir, dtype="float32")
    off = make_runner(model, max_num_seqs=2, num_blocks=8)
    with pytest.raises(NotImplementedError, match="enable_lora=True"):
        off.execute_model(_step([_new("x", checkpoints.requests["all-r8"])]))
    with pytest.raises(ValueError, match="enable_lora=True"):
        off.check_lora_request(checkpoints.requests["all-r8"])
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        ModelRunner(RunnerConfig(lora_config=LoRAConfig(), parallel_config=ParallelConfig(tensor_parallel_size=2)))
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        ModelRunner(RunnerConfig(lora_config=LoRAConfig(), speculative_config=SpeculativeConfig()))


def test_the_profile_run_measures_the_forward_with_lora(checkpoints, cache_dir):
    """KV cache sizing counts the LoRA product's activations: the largest steps compile with the slots."""
    with_lora = _runner(checkpoints, cache_dir, max_loras=4, max_lora_rank=16).profile_run().xla_bytes
    model, _ = load_model(checkpoints.base_dir, dtype="float32")
    plain = make_runner(model, max_num_seqs=4, max_num_batched_tokens=32, cache_dir=cache_dir).profile_run()
    assert with_lora > plain.xla_bytes
