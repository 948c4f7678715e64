"""Start-up to the first token from a safetensors checkpoint against from its orbax conversion.

Writes a random bf16 Llama checkpoint of ``--shape`` (transformers' ``save_pretrained``,
a byte tokenizer beside it), then, each in a fresh process: one start to fill the
compilation cache; a start from the safetensors (``LLM(checkpoint, quantization=...)``
and one generated token), which then converts the model (``llm.save_converted``);
and a start from the conversion. Both timed starts find every program compiled, so
they differ by what loading does: reading, merging, quantizing (with
``--quantization fp8``) and placing the safetensors' tensors, against orbax reading
each device's arrays as the runner holds them. The first tokens must agree.

    python -m benchmarks.converted_startup --shape llama3-8b --quantization fp8 --out converted_startup.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import SHAPES, device_facts, write_json

MAX_MODEL_LEN = 512
ENGINE: dict[str, Any] = dict(
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[32],
    request_buckets=[4],
)
"""Small buckets: the starts compile little, and what they compile comes from the cache."""


def write_checkpoint(shape: str, path: Path) -> None:
    """A random bf16 Llama of ``shape`` saved by transformers (on the GPU where torch has one), with a byte
    tokenizer."""
    import torch
    import transformers

    from benchmarks.hf_peer import build_config
    from jaxrunner.models.tokenizer import build_byte_tokenizer

    config = build_config(shape)  # the peer benchmark's Llama config of the shape
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)


def start(model: str, cache_dir: str, quantization: str | None, convert_to: str | None) -> dict:
    """The worker: build the engine, generate one token, then convert where asked; the seconds of each."""
    from jaxrunner import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model, compilation_cache_dir=cache_dir, quantization=quantization, **ENGINE)
    built = time.perf_counter()
    output = llm.generate("Hello, my name is", SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    first_token = time.perf_counter()
    result = {
        "construct_s": built - imported,
        "load_model_s": llm.llm_engine.spans.seconds.get("load_model", 0.0),
        "time_to_first_token_s": first_token - imported,
        "first_token_ids": list(output.outputs[0].token_ids),
        "programs": llm.llm_engine.runner.num_compiled_programs,
    }
    if convert_to is not None:
        llm.save_converted(convert_to)
        result["save_converted_s"] = time.perf_counter() - first_token
    return result


def run_worker(*args: str) -> dict:
    """``start`` in a fresh process (nothing loaded, nothing cached in memory); its JSON."""
    command = [sys.executable, "-m", "benchmarks.converted_startup", "--worker", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--quantization", choices=["fp8"], help="quantize as the safetensors load; unset: bf16")
    parser.add_argument("--scratch", help="where the checkpoint and its conversion go (default: a temporary folder)")
    parser.add_argument("--out", default="converted_startup.json")
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "CACHE_DIR", "QUANTIZATION", "CONVERT_TO"))
    args = parser.parse_args()
    if args.worker:
        model, cache_dir, quantization, convert_to = args.worker
        print(json.dumps(start(model, cache_dir, quantization or None, convert_to or None)))
        return
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        checkpoint, converted, cache = Path(scratch, "hf"), Path(scratch, "converted"), Path(scratch, "xla")
        began = time.perf_counter()
        write_checkpoint(args.shape, checkpoint)
        written = time.perf_counter() - began
        quantization = args.quantization or ""
        warm_up = run_worker(str(checkpoint), str(cache), quantization, "")
        safetensors = run_worker(str(checkpoint), str(cache), quantization, str(converted))
        restored = run_worker(str(converted), str(cache), "", "")
    if restored["first_token_ids"] != safetensors["first_token_ids"]:
        raise AssertionError(
            f"the converted model's first token {restored['first_token_ids']} is not "
            f"the checkpoint's {safetensors['first_token_ids']}"
        )
    result = dict(
        **device_facts(),
        shape=args.shape,
        quantization=args.quantization,
        checkpoint_write_s=written,
        warm_up=warm_up,
        safetensors=safetensors,
        converted=restored,
        speedup=safetensors["time_to_first_token_s"] / restored["time_to_first_token_s"],
        load_speedup=safetensors["load_model_s"] / restored["load_model_s"],
    )
    write_json(args.out, result)
    print(
        f"{result['device']}: start-up to the first token {safetensors['time_to_first_token_s']:.1f} s from "
        f"safetensors, {restored['time_to_first_token_s']:.1f} s from the conversion ({result['speedup']:.2f}x); "
        f"loading {safetensors['load_model_s']:.1f} s against {restored['load_model_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
