"""EAGLE with a head built to agree with its target: the drafts must be accepted.

The target is the tiny model with every layer's output projections zeroed, so
each layer passes its input through and the next token is a function of the
last token alone: ``lm_head(norm(embed(t)))``. The head's ``fc`` keeps the
token embedding and drops the feature, and its layer passes that through too,
so its draft logits are ``lm_head(embed(t))``: the target's up to the norm's
positive scale (a final norm of ones), hence the same greedy drafts. A head
that proposed anything else (all-zero drafts, a wrong position or feature)
would see its drafts rejected.
"""

import dataclasses

import numpy as np
import pytest
import transformers
from flax import nnx
from runner_driver import tiny_llm
from safetensors.numpy import save_file
from test_engine import _dispatch_order
from test_spec_decode import assert_same_logprobs

from jaxrunner.engine.llm import LLM
from jaxrunner.interfaces import SamplingParams
from jaxrunner.models import TransformerConfig
from jaxrunner.models.builtin import BUILTIN_MODELS
from jaxrunner.models.eagle import EagleHead
from jaxrunner.models.loader import hf_tensors, init_random_model
from jaxrunner.models.tokenizer import build_byte_tokenizer

TARGET = BUILTIN_MODELS["tiny-llama"]
NUM_SPEC = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)


def _hf_config(config: TransformerConfig, **overrides) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        **overrides,
    )


def _pass_through(tensors: dict[str, np.ndarray], prefix: str, num_layers: int) -> None:
    """Zero every layer's attention and MLP output projections: each layer returns its input."""
    for i in range(num_layers):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            tensors[f"{prefix}layers.{i}.{name}"] = np.zeros_like(tensors[f"{prefix}layers.{i}.{name}"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(target directory, agreeing EAGLE head directory)."""
    target_dir, head_dir = tmp_path_factory.mktemp("bigram_target"), tmp_path_factory.mktemp("agreeing_head")
    tensors = hf_tensors(init_random_model(TARGET, seed=1))
    _pass_through(tensors, "model.", TARGET.num_layers)
    tensors["model.norm.weight"] = np.ones_like(tensors["model.norm.weight"])
    save_file(tensors, str(target_dir / "model.safetensors"))
    _hf_config(TARGET, architectures=["LlamaForCausalLM"]).save_pretrained(target_dir)
    build_byte_tokenizer().save_pretrained(target_dir)

    head_config = dataclasses.replace(TARGET, num_layers=1)
    head = hf_tensors(EagleHead(head_config, rngs=nnx.Rngs(0)))
    hidden = TARGET.hidden_size
    head["fc.weight"] = np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))], axis=1).astype(np.float32)
    head["fc.bias"] = np.zeros(hidden, np.float32)
    _pass_through(head, "", 1)
    save_file(head, str(head_dir / "model.safetensors"))
    _hf_config(head_config, architectures=["EagleLlamaForCausalLM"]).save_pretrained(head_dir)
    return str(target_dir), str(head_dir)


def make_llm(cache_dir: str, model: str, **overrides) -> LLM:
    return tiny_llm(cache_dir, model, dtype="float32", **overrides)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 259, n).tolist() for n in (4, 19, 9, 30, 2)]


def test_an_agreeing_eagle_head_is_accepted_and_changes_no_token(cache_dir, checkpoints, monkeypatch):
    """Under async scheduling (the head drafts on the device): tokens and logprobs of the target
    alone, one step at a time, and every draft accepted."""
    target, head = checkpoints
    plain = make_llm(cache_dir, target, async_scheduling=False)
    expected = [o.outputs[0] for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]
    eagle = make_llm(
        cache_dir, target, speculative_config={"method": "eagle", "num_speculative_tokens": NUM_SPEC, "model": head}
    )
    events = _dispatch_order(eagle, monkeypatch)
    got = [o.outputs[0] for o in eagle.generate(prompts(), GREEDY, use_tqdm=False)]
    assert "DDR" in "".join(events)  # a step dispatched before the one before it was read
    for completion, want in zip(got, expected):
        assert_same_logprobs(completion, want)
    stats = eagle.llm_engine.scheduler.spec_stats
    # Every draft agrees; only the room left before max_tokens shortens some steps' drafts.
    assert stats.num_accepted == stats.num_drafts > 0
    assert stats.mean_accepted_length > NUM_SPEC
