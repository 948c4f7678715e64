"""Serving images: time to first token and output tokens/s for N requests of one image each, jaxrunner
against transformers on the same GPU, and the image encoder's share of the time.

A Qwen2.5-VL-7B-shaped model (``--shape qwen2.5-vl-7b``: the 7B's decoder and vision tower) with random
bf16 weights is written once as a HuggingFace checkpoint by transformers (with a byte-level tokenizer
carrying Qwen's special tokens, and Qwen2-VL's image processor at its default settings). Each of the N
prompts asks about its own random image (``--image-size`` pixels a side) and decodes ``--output-len``
tokens greedily, EOS ignored. Each side runs in a process of its own, one after the other:

- jaxrunner: ``LLM.generate`` on all N prompts at once, after a warm-up call; the time to first token
  is counted from the start of the call (image preprocessing included), per request. The encoder's
  share is one image's ``encode_image`` program timed alone, times N, over the call's wall time.
- transformers: ``Qwen2_5_VLForConditionalGeneration`` (sdpa attention, dynamic cache, eager: how a
  user runs it), N prompts in one ``generate`` (in batches of ``--hf-batch`` if set), preprocessing
  by the same image processor included; time to first token is one ``generate`` of one new token.

On the GPU (about 6 minutes with the checkpoint written):

    python -m benchmarks.vl_serving --out vl_serving.json

On a CPU, to check the script (a tiny model, small images):

    python -m benchmarks.vl_serving --shape tiny --num-requests 4 --image-size 56 --output-len 8 \\
        --out /tmp/vl_serving.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks.harness import write_json

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IM_END, VISION_START, IMAGE_PAD, VIDEO_PAD = 260, 261, 263, 264  # their ids after the byte tokenizer's 259
PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-7b": dict(
        text=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(
            depth=32, hidden_size=1280, out_hidden_size=3584, intermediate_size=3420, num_heads=16, patch_size=14,
            window_size=112, fullatt_block_indexes=[7, 15, 23, 31], spatial_merge_size=2, temporal_patch_size=2,
        ),
    ),
    "tiny": dict(
        text=dict(
            vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision=dict(
            depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=14,
            window_size=56, fullatt_block_indexes=[1], spatial_merge_size=2, temporal_patch_size=2,
        ),
    ),
}  # fmt: skip


def images(count: int, size: int) -> list[Image.Image]:
    """``count`` distinct RGB images of random pixels, ``size`` pixels a side."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


# ---------------------------------------------------------------- checkpoint


def write_checkpoint(shape: str, path: Path) -> None:
    """A random bf16 Qwen2.5-VL of ``shape``, its tokenizer and image processor, saved by transformers."""
    import torch
    import transformers

    from jaxrunner.models.tokenizer import build_byte_tokenizer

    spec = SHAPES[shape]
    config = transformers.Qwen2_5_VLConfig(
        text_config={**spec["text"], "eos_token_id": IM_END},
        vision_config=spec["vision"],
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD
    tokenizer.save_pretrained(path)
    vision = spec["vision"]
    transformers.Qwen2VLImageProcessor(
        patch_size=vision["patch_size"], temporal_patch_size=2, merge_size=vision["spatial_merge_size"]
    ).save_pretrained(path)


# ------------------------------------------------------------------ jaxrunner


def run_ours(args: argparse.Namespace) -> dict:
    import jax

    from benchmarks.harness import device_facts
    from jaxrunner import LLM, SamplingParams
    from jaxrunner.inputs import PromptType

    on_gpu = jax.default_backend() == "gpu"
    llm = LLM(
        str(args.checkpoint),
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        token_buckets=[args.num_requests, args.max_num_batched_tokens],
        request_buckets=[args.num_requests],
        patch_buckets=args.patch_buckets,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    pictures = images(args.num_requests + 1, args.image_size)
    prompts: list[PromptType] = [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in pictures]
    warm = llm.generate(prompts[-1:], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert warm[0].error is None, warm[0].error
    engine = llm.llm_engine
    encoder = engine.runner.encoder_runner
    assert encoder is not None, "a vision-language model"
    encoded_before = encoder.num_encoded
    start = time.monotonic()
    outputs = llm.generate(prompts[:-1], params, use_tqdm=False)
    wall = time.monotonic() - start
    assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error]
    ttft = [o.metrics.first_token_time - start for o in outputs if o.metrics and o.metrics.first_token_time]
    prompt_len = len(outputs[0].prompt_token_ids)

    # The encoder alone: one image through its program, timed on the device.
    processor = llm.mm_processor
    assert processor is not None
    _, features = processor.process(llm.get_tokenizer().encode(PROMPT), {"image": pictures[0]})
    patches = features[0].data
    compilation = engine.runner.compilation
    bucket = compilation.patch_bucket(patches.num_patches)
    program = compilation.encode_image.get(bucket)
    inputs = encoder.encode_image_inputs(patches, bucket, np.zeros(0, np.int32))  # no rows: nothing written
    cache = encoder.cache
    times = []
    for _ in range(args.encoder_repeats):
        began = time.perf_counter()
        cache = jax.block_until_ready(program(engine.runner._param_leaves, cache, *inputs))
        times.append(time.perf_counter() - began)
    encoder.cache = cache
    encode_s = statistics.median(times[1:] or times)
    preprocess = []
    for image in pictures[:8]:
        began = time.perf_counter()
        processor.process(llm.get_tokenizer().encode(PROMPT), {"image": image})
        preprocess.append(time.perf_counter() - began)
    return dict(
        **device_facts(),
        prompt_tokens=prompt_len,
        image_tokens=features[0].num_embeds,
        image_patches=patches.num_patches,
        patch_bucket=bucket,
        wall_s=wall,
        output_tokens_per_s=args.num_requests * args.output_len / wall,
        ttft_mean_s=statistics.mean(ttft),
        ttft_median_s=statistics.median(ttft),
        ttft_max_s=max(ttft),
        images_encoded=encoder.num_encoded - encoded_before,
        encode_one_image_s=encode_s,
        encoder_share=encode_s * args.num_requests / wall,
        preprocess_one_image_s=statistics.median(preprocess),
    )


# --------------------------------------------------------------- transformers


def run_hf(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        args.checkpoint, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
    image_processor: Any = transformers.AutoImageProcessor.from_pretrained(args.checkpoint)
    merge = model.config.vision_config.spatial_merge_size
    prompt_ids = tokenizer.encode(PROMPT)
    takes_token_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    def inputs_of(batch: list[Image.Image]) -> dict:
        processed = image_processor(images=batch, return_tensors="pt")
        rows = []
        for grid in processed["image_grid_thw"].tolist():
            count = grid[0] * grid[1] * grid[2] // merge**2
            rows.append([t for token in prompt_ids for t in ([token] * count if token == IMAGE_PAD else [token])])
        ids = torch.tensor(rows, device=device)
        inputs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=processed["pixel_values"].to(device, dtype),
            image_grid_thw=processed["image_grid_thw"].to(device),
        )
        if takes_token_types:  # transformers' newer models read the image tokens from the token types
            inputs["mm_token_type_ids"] = (ids == IMAGE_PAD).to(torch.int32)
        return inputs

    def generate(batch: list[Image.Image], new_tokens: int) -> None:
        with torch.no_grad():
            model.generate(
                **inputs_of(batch),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    def timed(new_tokens: int, batch_size: int) -> float:
        torch.cuda.synchronize() if device.type == "cuda" else None
        began = time.perf_counter()
        for first in range(0, args.num_requests, batch_size):
            generate(pictures[first : first + batch_size], new_tokens)
        torch.cuda.synchronize() if device.type == "cuda" else None
        return time.perf_counter() - began

    pictures = images(args.num_requests + 1, args.image_size)[: args.num_requests]
    generate(pictures[:2], 2)  # warm-up
    batch_size = args.hf_batch or args.num_requests
    while True:
        try:
            ttft = timed(1, batch_size)
            wall = timed(args.output_len, batch_size)
            break
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            torch.cuda.empty_cache()
    return dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        attention="sdpa",
        batch_size=batch_size,
        ttft_s=ttft,
        wall_s=wall,
        output_tokens_per_s=args.num_requests * args.output_len / wall,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    )


# ----------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-7b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=1024, help="pixels a side of each random image")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--patch-buckets", type=int, nargs="*", help="the image encoder's buckets (default ladder)")
    parser.add_argument("--encoder-repeats", type=int, default=6)
    parser.add_argument("--hf-batch", type=int, help="requests per transformers generate (default: all)")
    parser.add_argument("--checkpoint", type=Path, help="where the random checkpoint is (written if absent)")
    parser.add_argument("--part", choices=["both", "ours", "hf", "checkpoint"], default="both")
    parser.add_argument("--out", default="vl_serving.json")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.part == "checkpoint":
        write_checkpoint(args.shape, args.checkpoint)
        return
    if args.part != "both":
        assert args.checkpoint is not None
        result = run_ours(args) if args.part == "ours" else run_hf(args)
        write_json(args.out, result)
        return
    checkpoint = args.checkpoint or Path(tempfile.mkdtemp()) / f"random-{args.shape}"
    started = time.perf_counter()
    if not (checkpoint / "config.json").exists():  # in a process of its own: torch keeps the GPU memory it used
        part = [sys.executable, "-m", "benchmarks.vl_serving", *sys.argv[1:], "--part", "checkpoint"]
        subprocess.run([*part, "--checkpoint", str(checkpoint)], check=True)
    result: dict[str, Any] = dict(
        args={k: str(v) for k, v in vars(args).items()}, checkpoint_s=time.perf_counter() - started
    )
    for part in ("ours", "hf"):
        out = Path(tempfile.mkdtemp()) / f"{part}.json"
        command = [sys.executable, "-m", "benchmarks.vl_serving", *sys.argv[1:], "--part", part]
        command += ["--checkpoint", str(checkpoint), "--out", str(out)]
        began = time.perf_counter()
        run = subprocess.run(command)
        result[part] = json.loads(out.read_text()) if run.returncode == 0 else {"returncode": run.returncode}
        result[part]["process_s"] = time.perf_counter() - began
        write_json(args.out, result)
    ours, hf = result["ours"], result["hf"]
    if "wall_s" in ours and "wall_s" in hf:
        result["ours_over_hf_output_tokens_per_s"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["hf_over_ours_ttft_mean"] = hf["ttft_s"] / ours["ttft_mean_s"]
        write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()
