"""The sampling step's cost as a fraction of a decode step, features off and all on.

Times the jitted sampler alone (logits in, tokens and logprobs out) at a batch
and vocabulary, once with every row greedy and no feature used, once with
every feature on in every row (allowed ids, grammar bitmask, logit bias,
min_tokens, three penalties, bad words, temperature, min-p, top-k, top-p,
seeded noise, 20 logprobs); then the full decode step of the Llama-3-8B shape
at the same batch, in the same run, as the denominator.

    python -m benchmarks.sampler_step --out sampler_step.json
    python -m benchmarks.sampler_step --shape tiny --batch 4 --vocab 512 --context 32 --repeats 3 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import SHAPES, build_runner, device_facts, median_step, time_decode, write_json
from jaxrunner.config import SamplerConfig
from jaxrunner.sample.bitmask import num_words
from jaxrunner.sample.sampler import sample
from jaxrunner.sample.sampling_state import SamplingArrays


def sampling_state(batch: int, vocab: int, all_on: bool, rng) -> SamplingArrays:
    config = SamplerConfig()
    state = SamplingArrays.zeros(batch, config, vocab)
    if not all_on:
        return state
    r = lambda *shape: rng.integers(0, vocab, (batch, *shape)).astype(np.int32)
    allowed = np.full((batch, num_words(vocab)), -1, np.int32)  # every token allowed, but applied
    return SamplingArrays(
        **{
            **state.__dict__,
            "temperature": jnp.full(batch, 0.8),
            "top_k": jnp.full(batch, 50, jnp.int32),
            "top_p": jnp.full(batch, 0.9),
            "min_p": jnp.full(batch, 0.01),
            "seed_lo": jnp.arange(batch, dtype=jnp.uint32),
            "seed_hi": jnp.ones(batch, jnp.uint32),
            "repetition": jnp.full(batch, 1.1),
            "frequency": jnp.full(batch, 0.2),
            "presence": jnp.full(batch, 0.3),
            "min_tokens": jnp.full(batch, 4, jnp.int32),
            "stop_ids": jnp.asarray(r(config.max_stop_token_ids)),
            "bias_ids": jnp.asarray(r(config.max_logit_bias)),
            "bias_values": jnp.ones((batch, config.max_logit_bias)),
            "bad_words": jnp.asarray(r(config.max_bad_words, config.max_bad_word_len)),
            "has_allowed": jnp.ones(batch, bool),
            "allowed": jnp.asarray(allowed),
            "num_logprobs": jnp.full(batch, config.max_logprobs + 1, jnp.int32),
            "prompt_bitmask": jnp.asarray(
                rng.integers(-(2**31), 2**31 - 1, (batch, num_words(vocab)), dtype=np.int64).astype(np.int32)
            ),
            "output_counts": jnp.asarray(rng.integers(0, 3, (batch, vocab)).astype(np.int32)),
        }
    )


def time_sampler(batch: int, vocab: int, all_on: bool, repeats: int) -> float:
    rng = np.random.default_rng(0)
    state = sampling_state(batch, vocab, all_on, rng)
    token_ids = jnp.asarray(rng.integers(0, vocab, (batch, 64)).astype(np.int32))
    idx = jnp.arange(batch, dtype=jnp.int32)
    positions = jnp.full(batch, 40, jnp.int32)
    grammar = jnp.full((batch, num_words(vocab)), -1, jnp.int32)
    active = jnp.full(batch, all_on)
    run = jax.jit(
        lambda logits: sample(
            logits,
            state,
            token_ids,
            idx,
            positions,
            grammar,
            active,
            max_logprobs=SamplerConfig().max_logprobs,
            logprobs_mode="raw_logprobs",
        )
    )
    inputs = [jax.random.normal(jax.random.key(i), (batch, vocab), jnp.float32) * 3 for i in range(4)]
    jax.block_until_ready(run(inputs[0]))
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(inputs[i % len(inputs)]))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128 * 1024)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="sampler_step.json")
    args = parser.parse_args()

    sampler_ms = {
        mode: time_sampler(args.batch, args.vocab, mode == "all_on", args.repeats) * 1e3
        for mode in ("none_on", "all_on")
    }
    runner = build_runner(SHAPES[args.shape], [args.batch], args.context, steps=12)
    runner.capture_model()
    decode_ms = (
        median_step(time_decode(runner, args.batch, args.context, 12, np.random.default_rng(0), pipelined=True)) * 1e3
    )
    result = dict(
        **device_facts(),
        shape=args.shape,
        batch=args.batch,
        vocab=args.vocab,
        context=args.context,
        decode_step_ms=decode_ms,
        **{f"sampler_{k}_ms": v for k, v in sampler_ms.items()},
        **{f"sampler_{k}_fraction": v / decode_ms for k, v in sampler_ms.items()},
    )
    write_json(args.out, result)
    print(f"decode step (batch {args.batch}, {args.context} context): {decode_ms:.2f} ms")
    for mode, ms in sampler_ms.items():
        print(f"sampler {mode}: {ms:.3f} ms = {ms / decode_ms:.1%} of the decode step")


if __name__ == "__main__":
    main()
