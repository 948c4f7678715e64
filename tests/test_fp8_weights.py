"""FP8 weights (``models/quantization.py``, ``ops/fp8_matmul.py``): each checkpoint format, written by the test
the way its producer lays it out, loads and runs the function of its dequantized weights; on-load quantization
is the test's own quantization; W8A8 stays within FP8's error of the original; bad formats are refused; the
weights split over devices and restore from orbax unchanged; the engine compiles nothing after warm-up."""

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import (
    FP8_FORMATS,
    hf_logits,
    hf_logits_with_state,
    quantize_fp8,
    save_fp8_checkpoint,
    save_tiny_hf_model,
)
from packed_batch import packed_metadata
from runner_driver import tiny_llm
from safetensors.torch import load_file, save_file
from test_model_parity import jitted_step, pack, random_caches, random_prompts, rel_err
from test_sharding import tp_mesh

from benchmarks.fp8_matmul import reads_fp8_weight
from jaxrunner import envs
from jaxrunner.config import CUBLAS_GEMMS, CUBLAS_MIN_ROWS, CompilationConfig
from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import CheckpointError, load_model, loader
from jaxrunner.models.converted import save_converted
from jaxrunner.models.safetensors_io import iter_tensors
from jaxrunner.ops.fp8_matmul import FP8_MAX, WEIGHT_ONLY_MAX_TOKENS, fp8_matmul, fp8_matmul_impl, quantize_weight
from jaxrunner.runner.compilation import CompileCounter
from jaxrunner.sharding import kv_cache_sharding

LENS = [5, 19, 12]
NUM_TOKENS = 40
E4M3 = ml_dtypes.float8_e4m3fn


# ------------------------------------------------------------------ the matmuls


def _quantized_rows(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``x / scale`` saturated and rounded to e4m3 (numpy and ml_dtypes: independent of the op), as float64."""
    return np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(E4M3).astype(np.float64)


@pytest.mark.parametrize("input_scale", [None, 0.02])
def test_matmuls_compute_their_arithmetic_and_stay_near_the_unquantized_product(input_scale):
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (5, 64)).astype(np.float32)
    x[3] = 0.0  # a row of zeros: the smallest scale, no NaN
    w = rng.normal(0, 0.05, (3, 8, 64)).astype(np.float32)  # [*out, in]
    values, scale = quantize_weight(jnp.asarray(w))
    assert values.dtype == jnp.float8_e4m3fn and scale.shape == (3, 8)
    w_deq = np.asarray(values, np.float64) * np.asarray(scale, np.float64)[..., None]
    assert np.abs(w_deq - w).max() <= np.abs(w).max(-1, keepdims=True).max() / 16  # 3 mantissa bits
    args = (jnp.asarray(x), values, scale, None if input_scale is None else jnp.float32(input_scale))
    weight_only = np.asarray(fp8_matmul(*args, impl="weight_only", dtype=jnp.float32))
    np.testing.assert_allclose(weight_only, np.einsum("ti,abi->tab", x, w_deq), rtol=1e-5, atol=1e-5)

    x_scale = np.abs(x).max(-1, keepdims=True) / FP8_MAX if input_scale is None else np.float64(input_scale)
    x_scale = np.maximum(x_scale, 1 / (FP8_MAX * 512))
    want = np.einsum("ti,abi->tab", _quantized_rows(x, x_scale) * x_scale, w_deq)
    w8a8 = np.asarray(fp8_matmul(*args, impl="w8a8", dtype=jnp.float32))
    np.testing.assert_allclose(w8a8, want, rtol=1e-5, atol=1e-5)
    assert not w8a8[3].any()
    exact = np.einsum("ti,abi->tab", x, w)
    error = rel_err(w8a8, exact)
    print(f"W8A8 ({'static' if input_scale else 'per-token'} inputs) against the float32 product: {error:.4f}")
    assert error < (0.08 if input_scale is None else 0.2)  # a static scale saturates the largest inputs


def test_safetensors_reader_reads_fp8_tensors(tmp_path):
    values = torch.linspace(-400, 400, 37).reshape(1, 37)
    tensors = {"a": values.to(torch.float8_e4m3fn), "b": values.to(torch.float8_e5m2)}
    save_file(tensors, tmp_path / "x.safetensors")
    read = dict(iter_tensors(tmp_path / "x.safetensors"))
    assert read["a"].dtype == E4M3 and read["b"].dtype == ml_dtypes.float8_e5m2
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(read[name].astype(np.float32), tensor.float().numpy())


# ------------------------------------------------------------ checkpoints


def _logits(model, config, mesh=None) -> np.ndarray:
    metadata, positions = packed_metadata(LENS, block_size=4, num_blocks=24, num_tokens=NUM_TOKENS, num_reqs=4)
    caches = random_caches(config, model.dtype, 2)
    if mesh is not None:
        caches = jax.device_put(caches, kv_cache_sharding(mesh))
    prompts = random_prompts(config.vocab_size, LENS, seed=1)
    logits, _ = jitted_step(model)(pack(prompts, NUM_TOKENS), jnp.asarray(positions), caches, metadata)
    return np.asarray(logits)[: sum(LENS)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "bf16"
    save_tiny_hf_model("llama", path, seed=3)
    return path


@pytest.mark.parametrize("fmt", [*FP8_FORMATS, "on-load"])
def test_checkpoint_runs_its_dequantized_weights_and_w8a8_stays_near_the_original(fmt, source, tmp_path, monkeypatch):
    """Weight-only: the logits of transformers running the dequantized weights (< 1e-4, the same function);
    W8A8 (large buckets' choice where the checkpoint quantizes inputs): within FP8's error of the original model."""
    prompts = random_prompts(1031, LENS, seed=1)
    if fmt == "on-load":
        path, quantization = source, "fp8"
        state = {}
        for name, tensor in load_file(source / "model.safetensors").items():
            state[name] = tensor
            if name.endswith("proj.weight"):
                values, scale = quantize_fp8(tensor, per_channel=True)
                state[name] = values.float() * scale
    else:
        path, quantization = tmp_path / fmt, None
        state = save_fp8_checkpoint(source, path, fmt)
    dequantized = np.concatenate(hf_logits_with_state(source, state, prompts))
    original = np.concatenate(hf_logits(source, prompts))

    monkeypatch.setenv(envs.FP8_MATMUL_ENV_VAR, "weight_only")
    model, config = load_model(path, quantization=quantization)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.kernel is None and qkv.weight is not None and qkv.weight[...].dtype == jnp.float8_e4m3fn
    if fmt == "modelopt":  # the excluded MLP stays float32
        assert model.model.layers[2].mlp.down_proj.kernel[...].dtype == jnp.float32
    assert rel_err(_logits(model, config), dequantized) < 1e-4

    if fmt == "on-load":
        return  # its W8A8 is compressed-tensors-dynamic's case (the same quantization)
    monkeypatch.setenv(envs.FP8_MATMUL_ENV_VAR, "w8a8")
    model, config = load_model(path, quantization=quantization)
    w8a8 = _logits(model, config)
    error, weight_only_error = rel_err(w8a8, original), rel_err(dequantized, original)
    agreement = float(np.mean(w8a8.argmax(-1) == original.argmax(-1)))
    print(
        f"{fmt}: logits' relative error against the float32 original: W8A8 {error:.4f}, weight-only "
        f"{weight_only_error:.4f}; W8A8 greedy agreement {agreement:.3f} over {len(w8a8)} tokens"
    )
    # e4m3 rounds each value by up to 1/16 (3 mantissa bits): a few % a matmul, compounded over the tiny
    # random model's 12 matmuls. (Its logits are near ties: the greedy agreement is reported, not bounded.)
    assert error < 0.2 and weight_only_error < 0.15


def test_small_buckets_run_weight_only_and_large_ones_w8a8(source, monkeypatch):
    """Unforced, a step of at most ``WEIGHT_ONLY_MAX_TOKENS`` tokens runs the weight-only product even where
    the checkpoint quantizes inputs: its logits are the forced weight-only ones, not W8A8's."""
    assert NUM_TOKENS <= WEIGHT_ONLY_MAX_TOKENS
    assert fp8_matmul_impl(WEIGHT_ONLY_MAX_TOKENS + 1, "dynamic") == "w8a8"
    assert fp8_matmul_impl(WEIGHT_ONLY_MAX_TOKENS + 1, None) == "weight_only"  # no input quantization
    logits = {}
    for forced in (None, "weight_only", "w8a8"):
        if forced:
            monkeypatch.setenv(envs.FP8_MATMUL_ENV_VAR, forced)
        model, config = load_model(source, quantization="fp8")
        logits[forced] = _logits(model, config)
    np.testing.assert_array_equal(logits[None], logits["weight_only"])
    assert rel_err(logits[None], logits["w8a8"]) > 1e-3


def test_on_load_quantization_is_the_usual_per_channel_e4m3(source):
    model, _ = load_model(source, quantization="fp8")
    tensors = load_file(source / "model.safetensors")
    down = model.model.layers[1].mlp.down_proj
    values, scale = quantize_fp8(tensors["model.layers.1.mlp.down_proj.weight"], per_channel=True)
    np.testing.assert_array_equal(np.asarray(down.weight[...]).view(np.uint8), values.view(torch.uint8).numpy())
    np.testing.assert_allclose(np.asarray(down.weight_scale[...]), scale[:, 0].numpy(), rtol=1e-6)  # 1 ulp
    gate_up = model.model.layers[1].mlp.gate_up_proj  # [2, features, in]: each part its own scales
    up, up_scale = quantize_fp8(tensors["model.layers.1.mlp.up_proj.weight"], per_channel=True)
    np.testing.assert_array_equal(np.asarray(gate_up.weight[...][1]).view(np.uint8), up.view(torch.uint8).numpy())
    np.testing.assert_allclose(np.asarray(gate_up.weight_scale[...][1]), up_scale[:, 0].numpy(), rtol=1e-6)
    split = loader.hf_tensors(model)  # and back into HF's tensors, each part with its own
    np.testing.assert_array_equal(
        split["model.layers.1.mlp.up_proj.weight"].view(np.uint8), up.view(torch.uint8).numpy()
    )
    np.testing.assert_allclose(split["model.layers.1.mlp.up_proj.weight_scale"], up_scale[:, 0].numpy(), rtol=1e-6)
    assert (
        split["model.layers.0.self_attn.k_proj.weight"].shape == tensors["model.layers.0.self_attn.k_proj.weight"].shape
    )


def test_static_input_scale_of_a_merged_projection_is_its_parts_largest(source, tmp_path):
    save_fp8_checkpoint(source, tmp_path / "m", "compressed-tensors-static")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    model, _ = load_model(tmp_path / "m")
    parts = [tensors[f"model.layers.0.self_attn.{p}_proj.input_scale"] for p in "qkv"]
    assert len({float(p) for p in parts}) > 1
    assert float(model.model.layers[0].self_attn.qkv_proj.input_scale[...]) == max(float(p) for p in parts)


def _with_quantization(source, out, quantization: dict[str, Any]) -> None:
    out.mkdir()
    (out / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


CT = FP8_FORMATS["compressed-tensors-dynamic"]["config"]
CT_WEIGHTS = CT["config_groups"]["group_0"]["weights"]
BAD_CONFIGS = {
    "awq": ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    "int8": (
        {**CT, "format": "int-quantized"},
        "format 'int-quantized' is not supported",
    ),
    "block scales": (
        {
            **CT,
            "config_groups": {"g": {**CT["config_groups"]["group_0"], "weights": {**CT_WEIGHTS, "strategy": "block"}}},
        },
        "strategy 'block'",
    ),
    "fp8 blocks": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
    "nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4' is not supported"),
    "half a merged projection": ({**CT, "ignore": ["lm_head", "model.layers.0.self_attn.k_proj"]}, "one matmul"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_unsupported_quantization_configs_are_refused_naming_the_field(case, source, tmp_path):
    quantization, message = BAD_CONFIGS[case]
    _with_quantization(source, tmp_path / "m", quantization)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "m")


def test_mismatched_requests_are_refused(source, tmp_path, cache_dir):
    with pytest.raises(ValueError, match="quantization 'awq' is not supported"):
        load_model(source, quantization="awq")
    with pytest.raises(ValueError, match="pass quantization='fp8' to quantize it"):
        load_model(source, quantization="modelopt")
    save_fp8_checkpoint(source, tmp_path / "ct", "compressed-tensors-dynamic")
    with pytest.raises(ValueError, match="pass quantization='compressed-tensors'"):
        load_model(tmp_path / "ct", quantization="modelopt")
    # An FP8 tensor where the config keeps the module unquantized: refused, never cast without its scale.
    _with_quantization(tmp_path / "ct", tmp_path / "ignored", {**CT, "ignore": ["lm_head", "re:.*\\.o_proj"]})
    with pytest.raises(CheckpointError, match="o_proj.weight(_scale)?' is (an )?FP8.*holds this module unquantized"):
        load_model(tmp_path / "ignored")
    with pytest.raises(NotImplementedError, match="LoRA adapters on FP8 weights"):
        tiny_llm(cache_dir, quantization="fp8", enable_lora=True)
    save_tiny_hf_model("mixtral", tmp_path / "moe")
    with pytest.raises(ValueError, match="FP8 weights in a mixture-of-experts model"):
        load_model(tmp_path / "moe", quantization="fp8")


# ------------------------------------------------- devices, conversion, engine


@pytest.mark.parametrize(("quantization", "tp"), [(None, 8), ("fp8", 1), ("fp8", 8)])
def test_split_and_converted_models_give_the_unsplit_logits(quantization, tp, tmp_path, monkeypatch):
    """Over 8 CPU devices (8 KV heads) the FP8 model's logits (W8A8: per-token input scales over split
    features) are the one device's; converted with orbax (quantized as it loaded), it restores them exactly
    without reading a safetensors tensor."""
    monkeypatch.setenv(envs.FP8_MATMUL_ENV_VAR, "w8a8")
    source = tmp_path / "hf"
    save_tiny_hf_model("qwen3", source, seed=5, num_key_value_heads=8)
    want, _ = load_model(source, dtype="bfloat16", quantization=quantization)
    model, config = load_model(source, dtype="bfloat16", mesh=tp_mesh(tp), quantization=quantization)
    ours = _logits(model, config, tp_mesh(tp))
    # bf16 sums in another order over 8 devices: a few hundredths on a rare logit, a norm-wise 1e-2 at most
    assert rel_err(ours, _logits(want, config)) < 1e-2
    if quantization:
        weight = model.model.layers[0].mlp.gate_up_proj.weight[...]
        assert weight.dtype == jnp.float8_e4m3fn
        assert weight.addressable_shards[0].data.shape[1] == config.intermediate_size // tp  # split on features

    save_converted(nnx.state(model), model, source, tmp_path / "converted")
    monkeypatch.setattr(loader, "iter_tensors", lambda *a: pytest.fail("a converted model read safetensors"))
    restored, restored_config = load_model(tmp_path / "converted", dtype="bfloat16", mesh=tp_mesh(tp))
    assert restored_config.quantization == config.quantization
    np.testing.assert_array_equal(_logits(restored, config, tp_mesh(tp)), ours)


PROMPTS = [np.random.default_rng(0).integers(3, 250, n).tolist() for n in (5, 70, 33, 16, 1, 48, 90, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_engine_on_fp8_weights_and_fp8_kv_cache_compiles_nothing_after_warm_up(cache_dir):
    """The built-in model quantized as it loads, over an FP8 KV cache: mixed prefills and decodes compile
    nothing new; prefix caching, chunking and preemption change no token; the first tokens are the
    float32 model's (the rest reported)."""
    buckets: dict[str, Any] = dict(max_num_batched_tokens=32, token_buckets=[8, 32], request_buckets=[4])
    want = _greedy(tiny_llm(cache_dir, **buckets), PROMPTS)
    fp8 = dict(buckets, quantization="fp8", kv_cache_dtype="fp8")
    llm = tiny_llm(cache_dir, enable_prefix_caching=False, **fp8)
    compiled = CompileCounter.count()
    got = _greedy(llm, PROMPTS)  # prompts of up to 90 tokens: chunked prefills beside decodes
    assert CompileCounter.count() == compiled
    agreement = np.mean([a == b for x, y in zip(got, want) for a, b in zip(x, y)])
    first = np.mean([x[0] == y[0] for x, y in zip(got, want)])
    print(f"engine, FP8 weights and KV cache: greedy agreement {agreement:.3f}, first tokens {first:.3f}")
    assert first >= 0.75
    assert _greedy(tiny_llm(cache_dir, **fp8), PROMPTS + PROMPTS[:3])[: len(PROMPTS)] == got  # prefix hits
    tight = tiny_llm(cache_dir, num_gpu_blocks_override=8, enable_prefix_caching=False, **fp8)
    assert _greedy(tight, PROMPTS) == got
    assert tight.llm_engine.scheduler.num_preemptions > 0


_WEIGHT = "  %weight.1 = f8e4m3fn[6144,4096]{1,0} parameter(1)\n"
_SPLIT_K = "  %bitcast.2 = f8e4m3fn[6144,4,1024]{2,1,0} bitcast(%weight.1)\n"


@pytest.mark.parametrize(
    "program, reads",
    [
        # XLA's GPU programs as printed on the H100 (cut to the lines that matter): an FP8 GEMM on the weight,
        # the same on a split-K bitcast of it, a fused matrix-vector product of it.
        (_WEIGHT + '  %g = (f32[64,6144]{1,0}, s8[0]{0}) custom-call(%x.2, %weight.1), custom_call_target="m"', True),
        (_WEIGHT + _SPLIT_K + "  %g = (f32[4,64,6144]{2,1,0}) custom-call(%bitcast.1.0, %bitcast.2, %c, %c)", True),
        (_WEIGHT + "  %f = bf16[1,6144]{1,0} fusion(%x.1, %weight.1, %s), kind=kCustom", True),
        # A bf16 copy of the weight feeding the product; the product on another operand than the weight.
        (_WEIGHT + "  %w = bf16[6144,4096]{1,0} convert(%weight.1)\n  %g = (f32[64,6144]) custom-call(%x, %w)", False),
        (_WEIGHT + _SPLIT_K + "  %g = (f32[4,64,6144]{2,1,0}) custom-call(%bitcast.1.0, %bitcast.20)", False),
    ],
    ids=["gemm", "split-k-bitcast", "fused-gemv", "bf16-copy", "other-operand"],
)
def test_reads_fp8_weight_follows_the_weight_through_bitcasts_only(program, reads):
    assert reads_fp8_weight(program, 6144, 4096) == reads


def test_weight_only_buckets_keep_xlas_gemms_and_larger_ones_take_cublas(cache_dir):
    """cuBLAS has no FP8 x bf16 product (XLA widens the whole weight first): a program whose decoder runs the
    weight-only product is compiled for XLA's own GEMMs at any row count, one of W8A8 for cuBLAS from its
    row threshold; the LM head's programs (weights in bf16) follow the row threshold alone."""
    llm = tiny_llm(cache_dir, quantization="fp8", max_num_batched_tokens=128, token_buckets=[64, 128])
    compilation = llm.llm_engine.runner.compilation
    assert CUBLAS_MIN_ROWS <= WEIGHT_ONLY_MAX_TOKENS < 128
    assert compilation.compiler_options(WEIGHT_ONLY_MAX_TOKENS) == {}
    assert compilation.compiler_options(128) == CUBLAS_GEMMS
    assert compilation.compiler_options(WEIGHT_ONLY_MAX_TOKENS, decoder=False) == CUBLAS_GEMMS
    unquantized = tiny_llm(cache_dir, max_num_batched_tokens=128, token_buckets=[64, 128])
    assert unquantized.llm_engine.runner.compilation.compiler_options(WEIGHT_ONLY_MAX_TOKENS) == CUBLAS_GEMMS


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_each_buckets_product_reads_the_fp8_weight_without_a_wider_copy(rows):
    """On the GPU the product a bucket of ``rows`` runs, compiled with the options the runner gives it,
    takes the FP8 weight itself (an FP8 GEMM, or a fused product of the FP8 weight), never a bf16 copy of
    the converted weight."""
    key = jax.random.key(0)
    k, n = 4096, 6144  # the 8B's q/k/v
    values, scale = jax.jit(quantize_weight)(jax.random.normal(key, (n, k), jnp.bfloat16) * 0.02)
    x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.bfloat16)
    product = functools.partial(fp8_matmul, input_scale=None, dtype=jnp.bfloat16)
    impl = fp8_matmul_impl(rows, "dynamic")
    options = CompilationConfig().step_compiler_options(rows, fp8_weight_only=impl == "weight_only")
    lowered = jax.jit(functools.partial(product, impl=impl)).lower(x, values, scale)
    compiled = lowered.compile(compiler_options=options)  # pyright: ignore[reportArgumentType]
    hlo = compiled.as_text() or ""
    assert reads_fp8_weight(hlo, n, k), hlo[-3000:]
    want = np.asarray(product(x, values, scale, impl="w8a8" if impl == "weight_only" else "weight_only"), np.float32)
    assert rel_err(np.asarray(compiled(x, values, scale), np.float32), want) < 0.05
