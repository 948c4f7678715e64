"""The FP8 KV cache: quantized writes, attention over scaled pages, scales from checkpoints or first writes.

The ops against float64 oracles on the dequantized values (``fp8 * scale``);
a tiny model's logits and greedy tokens against its float32/bf16 cache; the
runner and engine with ``kv_cache_dtype="fp8"`` (no compile after warm-up,
scales computed once); checkpoint scales under vLLM's names.
"""

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import save_tiny_hf_model
from packed_batch import packed_metadata
from runner_driver import HandScheduler, make_runner, tiny_llm
from test_attention_reference import ODD, Case, _check, _dense_oracle, _make_inputs

from jaxrunner.config import CACHE_DTYPES, CacheConfig
from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import CausalLM, init_random_model, load_model
from jaxrunner.models.builtin import BUILTIN_MODELS
from jaxrunner.models.transformer import PENDING_KV_SCALE, KVScale
from jaxrunner.ops import AttentionBackend, ragged_paged_attention, write_kv
from jaxrunner.ops.kv_write import quantize_kv
from jaxrunner.runner.compilation import CompileCounter

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
# The largest relative rounding error of a normal value: half a unit in the last of 3 (2) mantissa bits.
ROUNDING = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
K_SCALE, V_SCALE = 0.05, 3.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _quantized(cache: jax.Array, dtype, scale: float) -> jax.Array:
    """A float cache as an FP8 cache of ``scale`` stores it."""
    rows = cache.reshape(-1, *cache.shape[2:])
    return quantize_kv(rows, dtype, jnp.float32(scale)).reshape(cache.shape)


# ------------------------------------------------------------------ the ops


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize(
    "case",
    [Case(), Case(reqs=ODD, block_size=8, sliding_window=17, soft_cap=3.0), Case(dtype=jnp.bfloat16)],
    ids=["mixed", "odd_window_cap", "mixed_bf16_queries"],
)
def test_attention_over_fp8_cache_matches_dense_oracle_on_dequantized_values(case, fmt):
    """Decodes, chunked prefills, odd lengths, shuffled block tables; non-trivial scales; the public entry
    (the reference here, the kernel where it takes FP8 pages)."""
    q, k_cache, v_cache, metadata = _make_inputs(case, seed=11)
    k_fp8 = _quantized(k_cache.astype(jnp.float32) * 2.0, FP8[fmt], K_SCALE)
    v_fp8 = _quantized(v_cache.astype(jnp.float32) * V_SCALE, FP8[fmt], V_SCALE)
    sm_scale = case.head_dim**-0.5
    out = ragged_paged_attention(
        q,
        k_fp8,
        v_fp8,
        metadata,
        sm_scale=sm_scale,
        k_scale=jnp.float32(K_SCALE),
        v_scale=jnp.float32(V_SCALE),
        sliding_window=case.sliding_window,
        soft_cap=case.soft_cap,
    )
    assert out.dtype == q.dtype
    k_real = np.asarray(k_fp8, np.float64) * K_SCALE
    v_real = np.asarray(v_fp8, np.float64) * V_SCALE
    want = _dense_oracle(case, q, k_real, v_real, metadata, sm_scale)
    _check(case, np.asarray(out, np.float64), want, tol=1e-5 if case.dtype == jnp.float32 else 1e-2)


def _spread_rows(fmt: str, scale: float, num_tokens: int, seed: int) -> np.ndarray:
    """Rows of ``scale`` times magnitudes log-uniform over the format's normal range, random signs;
    the last quarter of the tokens past its largest value (they must saturate)."""
    rng = np.random.default_rng(seed)
    info = jnp.finfo(FP8[fmt])
    low, high = np.log2(float(info.smallest_normal)), np.log2(float(info.max))
    magnitudes = 2.0 ** rng.uniform(low, high, (num_tokens, 2, 64))
    past = 3 * num_tokens // 4
    magnitudes[past:] = float(info.max) * rng.uniform(1.01, 1e3, (num_tokens - past, 2, 64))
    return (scale * magnitudes * rng.choice([-1.0, 1.0], magnitudes.shape)).astype(np.float32)


@pytest.mark.parametrize("impl", ["reference", "mosaic_gpu"])
@pytest.mark.parametrize("fmt", FP8)
def test_write_quantizes_within_fp8_precision_and_saturates(fmt, impl):
    """Both KV-write implementations (the kernel through its interpreter off a GPU): normal values come
    back within the format's rounding, values past its range come back as +-max * scale, never inf/NaN."""
    num_tokens, num_blocks, block_size = 40, 12, 8
    k_new, v_new = _spread_rows(fmt, K_SCALE, num_tokens, seed=1), _spread_rows(fmt, V_SCALE, num_tokens, seed=2)
    slots = np.random.default_rng(3).permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    slots[-3:] = -1  # padding: never written
    cache = jnp.zeros((num_blocks, block_size, 2, 64), FP8[fmt])
    k_cache, v_cache = write_kv(
        cache,
        cache,
        jnp.asarray(k_new),
        jnp.asarray(v_new),
        jnp.asarray(slots),
        k_scale=jnp.float32(K_SCALE),
        v_scale=jnp.float32(V_SCALE),
        impl=impl,
    )
    limit = float(jnp.finfo(FP8[fmt]).max)
    for stored, new, scale in ((k_cache, k_new, K_SCALE), (v_cache, v_new, V_SCALE)):
        flat = np.asarray(stored, np.float64).reshape(-1, 2, 64)
        assert np.isfinite(flat).all()
        written = slots >= 0
        back = flat[slots[written]] * scale
        want = new[written].astype(np.float64)
        inside = np.abs(want) <= limit * scale
        assert inside.any() and (~inside).any()
        rel = np.abs(back[inside] - want[inside]) / np.abs(want[inside])
        assert rel.max() <= ROUNDING[fmt]
        np.testing.assert_array_equal(back[~inside], np.sign(want[~inside]) * limit * scale)
        np.testing.assert_array_equal(np.delete(flat, slots[written], axis=0), 0.0)


# ---------------------------------------------------- a tiny model's outputs


def _teacher_forced_logits(
    model: CausalLM, prompts: list[list[int]], continuations: np.ndarray | int, kv_dtype, calculate_kv_scales: bool
) -> tuple[np.ndarray, list[float], np.ndarray]:
    """Logits after each prompt's prefill and after each of ``continuations`` ([steps, requests]) decoded one at
    a time, as the runner runs the model (merged in jit, the scales carried between steps); the scales; and
    the tokens fed. ``continuations`` as a number of steps feeds each step's greedy tokens instead.

    With ``calculate_kv_scales`` the scales start pending and the prefill sets them.
    """
    model.set_attributes(calculate_kv_scales=calculate_kv_scales)
    graphdef, params = nnx.split(model)
    scales = nnx.state(model, KVScale)
    if calculate_kv_scales:
        scales = jax.tree.map(lambda s: jnp.full_like(s, PENDING_KV_SCALE), scales)

    @jax.jit
    def step(params, scales, input_ids, positions, kv_caches, metadata):
        m = nnx.merge(graphdef, params)
        nnx.update(m, scales)
        hidden, kv_caches = m(input_ids, positions, kv_caches, metadata)
        return m.compute_logits(hidden), kv_caches, nnx.state(m, KVScale)

    config, num_blocks, block_size = model.config, 64, 16
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)) for _ in range(config.num_layers)]
    lens = [len(p) for p in prompts]
    packed = functools.partial(packed_metadata, block_size=block_size, num_blocks=num_blocks, blocks_per_req=8)
    metadata, positions = packed(lens)
    ids = jnp.asarray(np.concatenate(prompts), jnp.int32)
    logits, caches, scales = step(params, scales, ids, jnp.asarray(positions), caches, metadata)
    rows = [np.asarray(logits)[np.cumsum(lens) - 1]]
    greedy = isinstance(continuations, int)
    fed = np.zeros((continuations, len(prompts)), np.int32) if greedy else continuations
    for i in range(len(fed)):
        if greedy:
            fed[i] = rows[-1].argmax(-1)
        metadata, positions = packed([n + i + 1 for n in lens], [1] * len(lens))
        logits, caches, scales = step(params, scales, jnp.asarray(fed[i]), jnp.asarray(positions), caches, metadata)
        rows.append(np.asarray(logits))
    return np.stack(rows), [float(s) for s in jax.tree.leaves(scales)], fed


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_tiny_model_logits_and_greedy_tokens_close_to_the_unquantized_cache(model_dtype):
    """Scales from the prefill (calculate_kv_scales): each next token's logits, teacher-forced along the
    unquantized cache's greedy continuation, against that cache's."""
    model = init_random_model(BUILTIN_MODELS["tiny-llama"], dtype=model_dtype, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 40, 17, 60)]
    want, _, continuation = _teacher_forced_logits(model, prompts, 32, model_dtype, False)  # its greedy tokens
    bounds = {"e4m3": (0.1, 0.8), "e5m2": (0.2, 0.7)}  # (logits' relative error, greedy agreement)
    for fmt, (max_error, min_agreement) in bounds.items():
        got, scales, _ = _teacher_forced_logits(model, prompts, continuation, FP8[fmt], True)
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        agreement = float(np.mean(got.argmax(-1) == want.argmax(-1)))
        print(
            f"{model_dtype} model, fp8 {fmt} cache, computed scales: logits' relative error {error:.4f}, "
            f"greedy agreement {agreement:.3f} over {want.shape[0] * want.shape[1]} tokens"
        )
        assert all(0 < s < 1 for s in scales)  # set from the prefill: max|k| / 200, max|v| / 100
        assert error < max_error and agreement >= min_agreement


# ------------------------------------------------------------ checkpoints


def test_scales_load_from_checkpoint_names_and_attention_uses_them(tmp_path):
    """vLLM's names: ``k_scale``/``v_scale``, the older ``kv_scale``, compressed-tensors' ``output_scale``."""
    from safetensors.numpy import load_file, save_file

    save_tiny_hf_model("llama", tmp_path, seed=3)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    layer = "model.layers.{}.self_attn."
    tensors |= {
        layer.format(0) + "k_scale": np.array(0.02, np.float32),
        layer.format(0) + "v_scale": np.array([0.5], np.float32),
        layer.format(1) + "kv_scale": np.array(0.03, np.float32),
        layer.format(2) + "k_proj.output_scale": np.array(0.04, np.float32),
        layer.format(2) + "v_proj.output_scale": np.array(0.25, np.float32),
    }
    save_file(tensors, str(path))
    model, config = load_model(tmp_path)
    want = [(0.02, 0.5), (0.03, 0.03), (0.04, 0.25)]
    attns = [layer.self_attn for layer in model.model.layers]
    loaded_scales = [(a.k_scale[...], a.v_scale[...]) for a in attns]
    np.testing.assert_array_equal(np.array(loaded_scales), np.array(want, np.float32))

    prompts = [list(range(7, 40)), list(range(100, 111))]
    loaded, _, _ = _teacher_forced_logits(model, prompts, np.full((3, 2), 9), jnp.float8_e4m3fn, False)
    for attn in attns:  # the same scales by hand give the same logits; unit scales do not
        attn.k_scale.set_value(jnp.float32(1.0))
        attn.v_scale.set_value(jnp.float32(1.0))
    unit, _, _ = _teacher_forced_logits(model, prompts, np.full((3, 2), 9), jnp.float8_e4m3fn, False)
    for attn, (k_scale, v_scale) in zip(attns, want):
        attn.k_scale.set_value(jnp.float32(k_scale))
        attn.v_scale.set_value(jnp.float32(v_scale))
    by_hand, _, _ = _teacher_forced_logits(model, prompts, np.full((3, 2), 9), jnp.float8_e4m3fn, False)
    np.testing.assert_array_equal(loaded, by_hand)
    assert np.abs(loaded - unit).max() > 1e-3


def test_checkpoint_scales_must_be_one_positive_value_given_once(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxrunner.models import CheckpointError

    save_tiny_hf_model("llama", tmp_path, seed=3)
    path = tmp_path / "model.safetensors"
    base = load_file(path)
    name = "model.layers.0.self_attn."
    for extra, error in (
        ({name + "k_scale": np.ones(2, np.float32)}, "one value per layer"),
        ({name + "v_scale": np.array(-1.0, np.float32)}, "positive and finite"),
        ({name + "k_scale": np.array(1.0, np.float32), name + "kv_scale": np.array(1.0, np.float32)}, "set .*already"),
    ):
        save_file(base | extra, str(path))
        with pytest.raises(CheckpointError, match=error):
            load_model(tmp_path)


# ---------------------------------------------------------- runner, engine


def test_cache_dtype_names_are_vllms_and_a_bad_one_is_refused():
    assert {"auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"} <= set(CACHE_DTYPES)
    assert jnp.dtype(CACHE_DTYPES["fp8"]) == jnp.dtype(CACHE_DTYPES["fp8_e4m3"]) == jnp.float8_e4m3fn
    assert jnp.dtype(CACHE_DTYPES["fp8_e5m2"]) == jnp.float8_e5m2
    with pytest.raises(ValueError, match="'fp4' is not one of 'auto', 'bfloat16'.*'fp8_e5m2'"):
        CacheConfig(cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype.*'int8'"):
        LLM("tiny-llama", kv_cache_dtype="int8")


def test_a_cache_dtype_the_forced_kernel_cannot_read_is_refused_at_start(monkeypatch):
    from jaxrunner.envs import ATTENTION_IMPL_ENV_VAR

    forced = AttentionBackend("mosaic_gpu")
    with pytest.raises(ValueError, match="cannot read a float8_e4m3fn KV cache with head_dim 32.*takes"):
        forced.check_kv_cache_dtype(jnp.float8_e4m3fn, jnp.bfloat16, 32, 16)
    forced.check_kv_cache_dtype(jnp.bfloat16, jnp.bfloat16, 32, 16)  # the model's own dtype: as before
    forced.check_kv_cache_dtype(jnp.float8_e4m3fn, jnp.bfloat16, 128, 16)  # the kernel reads FP8 at head_dim 128
    AttentionBackend().check_kv_cache_dtype(jnp.float8_e4m3fn, jnp.bfloat16, 32, 16)  # automatic: reference
    monkeypatch.setenv(ATTENTION_IMPL_ENV_VAR, "mosaic_gpu")
    with pytest.raises(ValueError, match="kernel.*cannot read a float8_e5m2 KV cache"):
        make_runner(init_random_model(BUILTIN_MODELS["tiny-llama"]), cache_dtype="fp8_e5m2")


def _kv_scales(runner) -> list[float]:
    return [float(s) for s in jax.tree.leaves(runner.device_state.kv_scales)]


def test_runner_computes_scales_once_and_compiles_nothing_after_warm_up(tmp_path):
    """FP8 cache, calculate_kv_scales: random mixed steps (chunked prefills, decodes) after capture_model."""
    runner = make_runner(
        init_random_model(BUILTIN_MODELS["tiny-llama"], seed=1),
        max_num_seqs=6,
        max_num_batched_tokens=48,
        token_buckets=[4, 16, 48],
        request_buckets=[2, 6],
        cache_dir=str(tmp_path),
        cache_dtype="fp8",
        calculate_kv_scales=True,
    )
    runner.capture_model()
    assert runner.kv_caches is not None and runner.kv_caches[0][0].dtype == jnp.float8_e4m3fn
    assert _kv_scales(runner) == [PENDING_KV_SCALE] * 4
    compiled, programs = CompileCounter.count(), runner.num_compiled_programs
    rng = random.Random(0)
    scheduler = HandScheduler(runner, token_budget=48, seed=2)
    scales_after_first_step = None
    for step in range(60):
        if rng.random() < 0.3 or not (scheduler.waiting or scheduler.running):
            prompt = [rng.randrange(1, 250) for _ in range(rng.randint(1, 60))]
            scheduler.add(f"q{step}", prompt, GREEDY, rng.randint(1, 12))
        scheduler.token_budget = rng.randint(1, 48)
        scheduler.step()
        scales_after_first_step = scales_after_first_step or _kv_scales(runner)
    scheduler.run()
    assert CompileCounter.count() == compiled and runner.num_compiled_programs == programs
    assert scales_after_first_step is not None and all(s > 0 for s in scales_after_first_step)
    assert _kv_scales(runner) == scales_after_first_step  # computed once, then fixed


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


PROMPTS = [np.random.default_rng(0).integers(3, 250, n).tolist() for n in (5, 70, 33, 16, 1, 48, 90, 12)]


def test_engine_greedy_tokens_with_computed_scales(cache_dir):
    """Free-running greedy tokens against the float32 cache's (one flip makes the rest differ: reported),
    their first tokens (from the prefill) asserted; the scales, computed by the first step, stay for good
    (a second batch hits the prefix cache, whose blocks were written with them)."""
    want = _greedy(tiny_llm(cache_dir), PROMPTS)
    llm = tiny_llm(cache_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    compiled = CompileCounter.count()
    got = _greedy(llm, PROMPTS)
    assert CompileCounter.count() == compiled
    agreement = np.mean([a == b for x, y in zip(got, want) for a, b in zip(x, y)])
    first = np.mean([x[0] == y[0] for x, y in zip(got, want)])
    print(f"engine, fp8 cache, computed scales: greedy agreement {agreement:.3f}, first tokens {first:.3f}")
    assert first >= 0.8
    scales = _kv_scales(llm.llm_engine.runner)
    assert all(s > 0 for s in scales)
    _greedy(llm, PROMPTS[::-1])
    assert _kv_scales(llm.llm_engine.runner) == scales
    assert llm.kv_cache_manager.stats.hits > 0


def test_prefix_caching_chunking_and_preemption_change_no_fp8_output(cache_dir):
    """Unit scales (the loaded ones): the FP8 cache's outputs do not depend on how the steps were cut."""
    baseline = _greedy(tiny_llm(cache_dir, kv_cache_dtype="fp8", enable_prefix_caching=False), PROMPTS)
    assert _greedy(tiny_llm(cache_dir, kv_cache_dtype="fp8"), PROMPTS + PROMPTS[:2])[: len(PROMPTS)] == baseline
    tight = tiny_llm(cache_dir, kv_cache_dtype="fp8", num_gpu_blocks_override=14, enable_prefix_caching=False)
    assert _greedy(tight, PROMPTS) == baseline
    assert tight.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_speculative_decoding_over_fp8_caches_equals_no_speculation(method, cache_dir, tmp_path):
    """The drafter's cache is FP8 too, with its own computed scales; greedy outputs are the target's.

    One step at a time, because under async scheduling the steps are cut
    otherwise and FP8 rounding turns that into another token, not a bug. With
    max_num_seqs=4 the 1-token prompt (PROMPTS[4]) waits for a free slot; without
    speculation it prefills alone (token bucket 8), the async speculative run
    prefills it beside three other prompts (bucket 64). The two programs' float32
    results differ in the last bits (its first token's logprob agrees to < 1e-6),
    and one element of its layer-1 key at position 0 lies at the midpoint of two
    FP8 values (-200 in scale units, between -192 and -208): it is stored one
    FP8 step apart in the two runs, every other element of its KV and its
    slot's device state being equal. Attention over a context of one or two
    tokens does not average that step away: its later logprobs move by up to
    7.5e-3 and a token flips. Longer prompts, float32 caches, unit scales (other
    rounding midpoints) and max_num_seqs=8 (the same batches) agree.
    """
    from test_spec_decode import save_tiny_eagle_head

    # The batches (and so the rounding midpoints) these runs were checked on: every token bucket to 64.
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, token_buckets=[8, 16, 32, 64])
    plain = _greedy(tiny_llm(cache_dir, **fp8), PROMPTS)
    if method == "eagle":
        save_tiny_eagle_head(tmp_path)
    draft = "tiny-llama" if method == "draft_model" else str(tmp_path)
    spec = {"method": method, "num_speculative_tokens": 3, "model": draft}
    llm = tiny_llm(cache_dir, speculative_config=spec, async_scheduling=False, **fp8)
    compiled = CompileCounter.count()
    assert _greedy(llm, PROMPTS) == plain
    assert CompileCounter.count() == compiled
    runner = llm.llm_engine.runner
    assert runner.draft_kv_caches[0][0].dtype == jnp.float8_e4m3fn
    assert all(float(s) > 0 for s in jax.tree.leaves(runner.device_state.draft_kv_scales))
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0


def test_tensor_parallel_fp8_follows_one_device(cache_dir):
    """TP=2: each device quantizes its KV heads with the scales computed over all of them.

    Not token for token: TP's other float32 summation order moves a value across an FP8 rounding
    boundary now and then, which a random tiny model's narrow logit margins turn into another token.
    """
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    one = tiny_llm(cache_dir, **fp8)
    two = tiny_llm(cache_dir, tensor_parallel_size=2, **fp8)
    got, want = _greedy(two, PROMPTS), _greedy(one, PROMPTS)
    agreement = np.mean([a == b for x, y in zip(got, want) for a, b in zip(x, y)])
    print(f"fp8 cache, TP=2 against one device: greedy agreement {agreement:.3f}")
    assert agreement >= 0.9 and [x[0] for x in got] == [y[0] for y in want]
    assert _kv_scales(two.llm_engine.runner) == pytest.approx(_kv_scales(one.llm_engine.runner), rel=1e-6)


def test_fp8_cache_halves_the_bytes_per_block():
    model = init_random_model(BUILTIN_MODELS["tiny-llama"], dtype="bfloat16")
    bf16 = make_runner(model, num_blocks=4).kv_cache_spec
    fp8 = make_runner(model, num_blocks=4, cache_dtype="fp8").kv_cache_spec
    assert dataclasses.replace(fp8, dtype=bf16.dtype) == bf16
    assert 2 * fp8.bytes_per_block == bf16.bytes_per_block
