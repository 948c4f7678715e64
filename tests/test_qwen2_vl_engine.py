"""Serving Qwen2-VL and Qwen2.5-VL through ``LLM``: images in prompts and chats, against transformers' greedy
``generate`` (float32), with chunked prefill splitting images, preemption, the encoder cache and prefix caching."""

import base64
import io
import re

import numpy as np
import pytest
import transformers
from runner_driver import tiny_llm
from vl_models import IMAGE_PROMPT, hf_greedy, random_image, save_tiny_vl_checkpoint

from jaxrunner import LLM, SamplingParams
from jaxrunner.inputs import TextPrompt, TokensPrompt
from jaxrunner.runner.compilation import CompileCounter

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def chat_text(*parts: str) -> str:
    return "<|im_start|>user\n" + "".join(parts) + "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_vl_checkpoint(request.param, path)


def make_llm(path, **kwargs) -> LLM:
    """A float32 engine with few buckets (few programs to compile), 16 tokens a step unless given."""
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, request_buckets=[4])
    options = {**options, **kwargs}
    return LLM(str(path), token_buckets=[4, options["max_num_batched_tokens"]], **options)


def engine_state_is_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    encoder_cache = engine.scheduler.encoder_cache_manager
    assert encoder_cache is not None and encoder_cache.num_referenced_slots == 0
    runner_cache = engine.runner.encoder_runner
    assert (
        runner_cache is not None
        and runner_cache.num_cached_rows == encoder_cache.cache_size - encoder_cache.num_free_slots
    )
    assert not runner_cache.req_features


def test_greedy_batch_of_image_and_text_prompts_matches_transformers(checkpoint):
    """One image, two images (one repeated from another prompt), text only: chunks of 16 tokens split every
    image (up to 25 placeholders), and a KV cache of 12 blocks preempts requests."""
    path, hf_model = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    cat, dog, bird = random_image(40, 40, 0), random_image(24, 40, 1), random_image(32, 32, 2)
    prompts = [
        (chat_text(IMAGE_PROMPT, "What is this?"), [cat]),
        (chat_text("Compare ", IMAGE_PROMPT, " and ", IMAGE_PROMPT, "."), [dog, cat]),
        (chat_text("No picture here, just words."), []),
        (chat_text(IMAGE_PROMPT, "And this one?"), [bird]),
    ]
    expected = [hf_greedy(hf_model, tokenizer.encode(text), images, MAX_TOKENS) for text, images in prompts]

    llm = make_llm(path, num_gpu_blocks_override=12)
    compiles = CompileCounter.count()
    outputs = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in prompts],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.error for o in outputs] == [None] * len(prompts)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert CompileCounter.count() == compiles  # nothing compiles after warm-up
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.encoder_runner is not None
    assert engine.runner.encoder_runner.num_encoded == 3  # cat once, though two prompts carry it
    engine_state_is_clean(llm)


def test_prefix_cache_shares_a_repeated_image_never_a_different_one(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path, max_num_batched_tokens=64)
    text = chat_text(IMAGE_PROMPT, "Describe the picture in detail, please.")
    manager = llm.kv_cache_manager
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": random_image(40, 40, 0)}}, GREEDY, False)
    prompt_len = len(first[0].prompt_token_ids)
    manager.reset_stats()
    llm.generate({"prompt": text, "multi_modal_data": {"image": random_image(40, 40, 0)}}, GREEDY, False)
    same = manager.reset_stats()
    llm.generate({"prompt": text, "multi_modal_data": {"image": random_image(40, 40, 5)}}, GREEDY, False)
    other = manager.reset_stats()
    block = manager.block_size
    assert same.hits == (prompt_len - 1) // block * block  # every full block, the image's included
    assert other.hits == 0  # the image starts in the first block: nothing before it is shared
    runner = llm.llm_engine.runner
    assert runner.encoder_runner is not None and runner.encoder_runner.num_encoded == 2
    engine_state_is_clean(llm)


def test_chat_with_image_parts_equals_the_rendered_prompt(checkpoint):
    path, _ = checkpoint
    llm = make_llm(path)
    image = random_image(32, 40, 3)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    by_url = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "Hi"}],
        }
    ]
    by_pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Hi"}]}]
    ids = llm.get_tokenizer().encode(chat_text(IMAGE_PROMPT, "Hi"), add_special_tokens=False)  # as the template
    rendered = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": image})
    expected = llm.generate(rendered, GREEDY, use_tqdm=False)[0]
    assert expected.error is None
    for conversation in (by_url, by_pil):
        output = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
        assert output.error is None
        assert output.prompt_token_ids == expected.prompt_token_ids
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids


def good_image():
    return random_image(16, 16, 1)


def test_bad_images_are_refused_alone(checkpoint, tmp_path):
    path, _ = checkpoint
    llm = make_llm(path, max_model_len=40, limit_mm_per_prompt={"image": 1})
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    one = chat_text(IMAGE_PROMPT)
    good = TextPrompt(prompt=chat_text(IMAGE_PROMPT, "ok"), multi_modal_data={"image": random_image(16, 16, 0)})
    cases = [
        (TextPrompt(prompt=one, multi_modal_data={"image": str(not_an_image)}), "cannot be read"),
        (TextPrompt(prompt=one, multi_modal_data={"image": 42}), "an image must be a PIL image"),
        (
            TextPrompt(prompt=chat_text(IMAGE_PROMPT, IMAGE_PROMPT), multi_modal_data={"image": [good_image()] * 2}),
            r"2 images, more than limit_mm_per_prompt allows \(1\)",
        ),
        (
            TextPrompt(prompt=one, multi_modal_data={"image": random_image(40, 40, 2)}),
            r"more than max_model_len \(40\)",
        ),
        (TextPrompt(prompt=chat_text("words"), multi_modal_data={"image": good_image()}), "0 image placeholders"),
        (TextPrompt(prompt=one, multi_modal_data={"video": [np.zeros((2, 8, 8, 3), np.uint8)]}), "'video'"),
    ]
    outputs = llm.generate([good, *(prompt for prompt, _ in cases), good], GREEDY, use_tqdm=False)
    assert outputs[0].error is None and outputs[-1].error is None
    assert len(outputs[0].outputs[0].token_ids) == MAX_TOKENS
    for output, (_, message) in zip(outputs[1:-1], cases):
        assert output.error is not None and output.outputs[0].finish_reason == "error"
        assert re.search(message, output.error), (message, output.error)
    engine_state_is_clean(llm)


def test_a_text_model_refuses_images_for_that_prompt_alone(cache_dir):
    llm = tiny_llm(cache_dir, max_model_len=64, max_num_seqs=2, request_buckets=[2])
    outputs = llm.generate(
        ["plain text", {"prompt": "look", "multi_modal_data": {"image": random_image(8, 8, 0)}}],
        SamplingParams(max_tokens=3),
        use_tqdm=False,
    )
    assert outputs[0].error is None
    assert outputs[1].error is not None and "this model takes no images" in outputs[1].error
