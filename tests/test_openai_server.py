"""The OpenAI-compatible server through the real ``openai`` client: one server on 127.0.0.1 for the
module (the built-in tiny model, a random LoRA adapter served by name, an API key), driven over HTTP.

Completions and chat, streamed and not, with ``n``, logprobs, stop strings, seeds and a JSON schema;
100 concurrent streams give each client the tokens it gets alone; a client that leaves frees its
request; bad requests get a 400 naming the field while good ones run; ``/metrics`` parses.
"""

import asyncio
import collections
import json
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from jaxrunner.engine.llm import LLM
from jaxrunner.engine.outputs import RequestOutput
from jaxrunner.entrypoints.async_llm import RequestRefusedError
from jaxrunner.entrypoints.openai_server import build_app
from jaxrunner.interfaces import SamplingParams
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models.builtin import BUILTIN_MODELS
from jaxrunner.models.random_lora import save_random_lora_adapter
from jaxrunner.models.tokenizer import BYTE_OFFSET

API_KEY = "test-key"
MODEL = "tiny"
ADAPTER = "random-r4"
GREEDY: dict[str, Any] = dict(temperature=0.0, extra_body={"return_token_ids": True})


class _Server:
    """A uvicorn server on a free port of 127.0.0.1, in a thread of the test process."""

    def __init__(self, app):
        self.app = app
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    adapter_dir = tmp_path_factory.mktemp("adapter") / ADAPTER
    save_random_lora_adapter(adapter_dir, BUILTIN_MODELS["tiny-llama"], rank=4, b_std=0.2)
    lora = LoRARequest(ADAPTER, 1, str(adapter_dir))
    llm = LLM(
        "tiny-llama",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=200,
        token_buckets=[8, 32, 64],
        request_buckets=[2, 8],
        compilation_cache_dir=cache_dir,
        enable_lora=True,
        max_lora_rank=4,
    )
    with _Server(build_app(llm, MODEL, [lora], api_key=API_KEY)) as running:
        yield running
    assert running.app.state.engine.dead is not None  # the app's shutdown stopped the engine thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def metrics(server) -> dict[str, float]:
    """``/metrics`` parsed as Prometheus text: each sample's value by its name (labels dropped, one model)."""
    text = httpx.get(f"{server.url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "le" not in sample.labels
    }


def wait_until_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """The metrics once no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        idle = values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0
        if idle and values["vllm:kv_cache_usage_perc"] == 0:
            return values
        assert time.monotonic() < deadline, f"still busy: {values}"
        time.sleep(0.05)


def token_ids(choice) -> list[int]:
    """A choice's (or a chunk's) token ids: vLLM's ``return_token_ids`` field, an extra to the openai client."""
    return choice.token_ids


def streamed_completion(client, **kwargs) -> tuple[list[str], list[list[int]], list[str | None]]:
    """Each choice's text, token ids and finish reason, put together from a completions stream."""
    texts, tokens, reasons = collections.defaultdict(str), collections.defaultdict(list), {}
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.token_ids
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    indices = sorted(texts)
    assert indices == list(range(len(indices)))
    return [texts[i] for i in indices], [tokens[i] for i in indices], [reasons.get(i) for i in indices]


def test_completions_streamed_and_not_agree_with_n_and_logprobs(client):
    kwargs = dict(prompt=["Hello, my name is", "The capital of France"], max_tokens=12, n=2, logprobs=3, **GREEDY)
    whole = client.completions.create(model=MODEL, **kwargs)
    assert len(whole.choices) == 4 and [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == 4 * 12
    assert whole.usage.prompt_tokens == sum(len(c.prompt_token_ids) for c in whole.choices[::2])
    for choice in whole.choices:
        assert len(choice.token_ids) == 12 and choice.finish_reason == "length"
        assert len(choice.logprobs.token_logprobs) == 12 and len(choice.logprobs.tokens) == 12
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
        # Greedy: each token is the most likely one. (Tokens of the same text share a key in the legacy format.)
        for logprob, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
            assert top and logprob >= max(top.values()) - 1e-6
    assert whole.choices[0].token_ids == whole.choices[1].token_ids != whole.choices[2].token_ids
    texts, tokens, reasons = streamed_completion(client, **kwargs)
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.token_ids for c in whole.choices]
    assert reasons == ["length"] * 4


def test_chat_streamed_and_not_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kwargs = dict(messages=messages, max_tokens=10, logprobs=True, top_logprobs=2, **GREEDY)
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 10 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    # The prompt is the chat template's rendering of the messages.
    template = "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    assert whole.usage.prompt_tokens == len(template.encode()) - 2 - 2 * 3  # a token for <s>, one for each </s>

    text, roles, reasons, logprobs = "", [], [], 0
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for delta in chunk.choices:
            text += delta.delta.content or ""
            roles += [delta.delta.role] if delta.delta.role else []
            reasons += [delta.finish_reason] if delta.finish_reason else []
            logprobs += len(delta.logprobs.content) if delta.logprobs else 0
    assert (text, roles, reasons, logprobs) == (choice.message.content, ["assistant"], ["length"], 10)


def test_stop_string_ends_the_text_before_it(client):
    texts = [
        c.text for c in client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, **GREEDY).choices
    ]
    stop = next(ch for ch in texts[0][1:] if ch.isascii() and ch.isprintable())  # a character it generates
    expected = texts[0][: texts[0].index(stop)]
    choice = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, stop=[stop], **GREEDY).choices[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (expected, "stop", stop)
    streamed, _, reasons = streamed_completion(client, prompt="Stop here", max_tokens=24, stop=stop, **GREEDY)
    assert (streamed, reasons) == ([expected], ["stop"])


def test_a_seed_gives_the_same_text_twice(client):
    def sample(seed: int) -> tuple[str, list[int]]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story"}],
            temperature=1.0,
            max_tokens=16,
            seed=seed,
            extra_body={"return_token_ids": True},
        )
        return reply.choices[0].message.content, reply.choices[0].token_ids

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321)[1] != first[1]


def test_json_schema_reply_parses_and_matches(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON"}],
        max_tokens=200,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        # The random model would fill the whitespace JSON allows between tokens: no whitespace bytes.
        logit_bias={str(BYTE_OFFSET + ord(c)): -100 for c in " \t\n\r"},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and 0 <= person["age"] <= 120


def test_lora_adapter_is_served_as_a_model_name(client):
    assert [m.id for m in client.models.list()] == [MODEL, ADAPTER]
    kwargs = dict(prompt="Adapters", max_tokens=8, **GREEDY)
    base = client.completions.create(model=MODEL, **kwargs).choices[0].token_ids
    adapted = client.completions.create(model=ADAPTER, **kwargs).choices[0].token_ids
    assert adapted != base
    assert client.completions.create(model=ADAPTER, **kwargs).choices[0].token_ids == adapted
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-model", **kwargs)
    assert error.value.param == "model"


def test_100_concurrent_streams_each_get_their_tokens_alone(server, client):
    prompts = [f"Client {i} says {'ab' * (i % 23)}" for i in range(100)]
    kwargs: dict[str, Any] = dict(max_tokens=6, **GREEDY)
    alone = []
    for prompt in prompts:
        choice = client.completions.create(model=MODEL, prompt=prompt, **kwargs).choices[0]
        alone.append((choice.token_ids, choice.finish_reason))

    async def stream(async_client: openai.AsyncOpenAI, prompt: str) -> tuple[list[int], str | None]:
        tokens, reason = [], None
        async for chunk in await async_client.completions.create(model=MODEL, prompt=prompt, stream=True, **kwargs):
            for choice in chunk.choices:
                tokens += token_ids(choice)
                reason = choice.finish_reason or reason
        return tokens, reason

    async def all_at_once():
        # The server shares this process (and its GIL) with the engine and the 100 clients: on a loaded
        # 2-core machine a connection can take longer than the client's default 5 s to be accepted.
        timeout = openai.Timeout(120.0, connect=60.0)
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout
        ) as async_client:
            return await asyncio.gather(*(stream(async_client, p) for p in prompts))

    together = asyncio.run(all_at_once())
    assert together == alone
    lengths = [len(tokens) for tokens, _ in together]
    assert max(lengths) == 6 and sum(lengths) > 90 * 6  # most ran to max_tokens (a few met EOS)
    wait_until_idle(server)


def test_a_client_that_leaves_frees_its_request(server, client):
    wait_until_idle(server)
    before = metrics(server)["vllm:generation_tokens_total"]
    stream = client.completions.create(
        model=MODEL, prompt="A long story", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _chunk in zip(range(5), stream):
        pass
    assert metrics(server)["vllm:num_requests_running"] == 1
    stream.close()
    after = wait_until_idle(server, timeout=2.0)["vllm:generation_tokens_total"]
    assert after - before < 1500
    # Not streamed: a client that gives up waiting (here a read timeout) aborts its request as well.
    before = after
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(
            model=MODEL, prompt="Another long story", max_tokens=1500, extra_body={"ignore_eos": True}
        )
    after = wait_until_idle(server, timeout=2.0)["vllm:generation_tokens_total"]
    assert 0 < after - before < 1500
    engine = server.app.state.engine.llm.llm_engine
    assert engine.scheduler.num_unfinished == 0


def test_async_llm_generate_streams_deltas_and_aborts_when_closed(server):
    """vLLM's ``AsyncLLM.generate`` on the server's engine, from an event loop of the test's own."""
    engine = server.app.state.engine
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def first_outputs(request_id: str, count: int) -> list[RequestOutput]:
        outputs = []
        generator = engine.generate(request_id, "Async prompt", params)
        async for output in generator:
            outputs.append(output)
            if len(outputs) == count:
                break
        await generator.aclose()
        return outputs

    outputs = asyncio.run(first_outputs("async-llm-0", 4))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 4  # deltas, a token each
    assert not outputs[-1].finished
    wait_until_idle(server, timeout=2.0)  # closing the generator aborted the request
    with pytest.raises(RequestRefusedError, match="max_model_len"):
        asyncio.run(engine.add_request("async-llm-1", "x" * 3000, params))


BAD_REQUESTS = [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=1000), "logprobs"),  # past the engine's max_logprobs: refused by the engine itself
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 2.0}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    (dict(extra_body={"n": "2"}), "n"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(extra_body={"response_format": {"type": "xml"}}), "response_format.type"),
    (dict(prompt="x" * 3000), "prompt"),  # longer than max_model_len
    (dict(prompt=[]), "prompt"),
]


def test_bad_requests_get_400_naming_the_field_while_good_ones_finish(server, client):
    async def good(async_client: openai.AsyncOpenAI, i: int) -> str | None:
        reason = None
        stream = await async_client.completions.create(
            model=MODEL, prompt=f"good {i}", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            reason = chunk.choices[0].finish_reason or reason
        return reason

    async def bad(async_client: openai.AsyncOpenAI, kwargs: dict) -> openai.BadRequestError:
        await asyncio.sleep(0.05)  # while the good ones run
        with pytest.raises(openai.BadRequestError) as error:
            await async_client.completions.create(**{"model": MODEL, "prompt": "bad", "max_tokens": 4, **kwargs})
        return error.value

    async def run():
        # The server shares this process (and its GIL) with the engine and the 100 clients: on a loaded
        # 2-core machine a connection can take longer than the client's default 5 s to be accepted.
        timeout = openai.Timeout(120.0, connect=60.0)
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout
        ) as async_client:
            goods = asyncio.gather(*(good(async_client, i) for i in range(8)))
            bads = asyncio.gather(*(bad(async_client, kwargs) for kwargs, _ in BAD_REQUESTS))
            return await asyncio.gather(goods, bads)

    reasons, errors = asyncio.run(run())
    assert reasons == ["length"] * 8
    for error, (kwargs, param) in zip(errors, BAD_REQUESTS):
        assert (error.status_code, error.param, error.type) == (400, param, "BadRequestError"), (kwargs, error.message)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"content": "no role"}])
    assert error.value.param == "messages.0.role"
    # A client may not make the server read its files.
    image = {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [image]}])
    assert error.value.param == "messages.0.content.0"
    wait_until_idle(server)


def test_api_key_is_required_on_v1_only(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_parse_as_prometheus_text(server):
    text = httpx.get(f"{server.url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert families[name].type == "counter"
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert families[name].type == "histogram"
    values = metrics(server)
    assert values["vllm:prompt_tokens_total"] > 0 and values["vllm:generation_tokens_total"] > 100 * 6
    assert values["vllm:time_to_first_token_seconds_count"] >= 100
    assert values["vllm:inter_token_latency_seconds_count"] >= 100 * 5
    # The concurrent clients' prompts share their first blocks: the prefix cache found them.
    assert 0 < values["vllm:prefix_cache_hits_total"] < values["vllm:prefix_cache_queries_total"]


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_server_answers_503_while_the_model_loads_then_serves(cache_dir):
    release = threading.Event()

    def make_llm() -> LLM:
        assert release.wait(60), "the test never let the model load"
        return LLM(
            "tiny-llama",
            max_num_seqs=2,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=64,
            token_buckets=[8, 32],
            request_buckets=[2],
            compilation_cache_dir=cache_dir,
        )

    errors: list[BaseException] = []
    with _Server(build_app(make_llm, MODEL, on_load_error=errors.append)) as running:
        assert httpx.get(f"{running.url}/health").status_code == 503
        reply = httpx.get(f"{running.url}/v1/models")
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert "still loading" in reply.json()["error"]["message"]
        release.set()
        _wait_for(lambda: errors or httpx.get(f"{running.url}/health").status_code == 200, 300, "the model to load")
        assert not errors
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        completion = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, **GREEDY)
        assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_a_model_that_fails_to_load_is_reported_and_answers_503():
    errors: list[BaseException] = []

    def make_llm() -> LLM:
        raise ValueError("no checkpoint at /nowhere")

    with _Server(build_app(make_llm, MODEL, on_load_error=errors.append)) as running:
        _wait_for(lambda: bool(errors), 30, "the load to fail")
        assert isinstance(errors[0], ValueError)
        assert httpx.get(f"{running.url}/health").status_code == 503
        reply = httpx.post(f"{running.url}/v1/completions", json=dict(model=MODEL, prompt="a"))
        assert reply.status_code == 503 and "no checkpoint at /nowhere" in reply.json()["error"]["message"]
