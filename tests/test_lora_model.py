"""The model with LoRA adapters in slots against PEFT on transformers: same base checkpoint, same adapters,
every token of a packed batch on its own request's adapter (or none)."""

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from hf_models import save_tiny_hf_model
from packed_batch import packed_metadata
from test_model_parity import BLOCK_SIZE, NUM_BLOCKS, pack, random_caches, random_prompts, rel_err

from jaxrunner.models import load_model
from jaxrunner.models.lora import (
    LORA_MODULES,
    LoRABatch,
    LoRAWeights,
    adapter_arrays,
    add_lora_columns,
    lora_kernel_leaves,
    set_slot,
)
from jaxrunner.models.lora_adapter import read_lora_adapter
from jaxrunner.models.random_lora import save_random_lora_adapter
from jaxrunner.runner.compilation import CompileCounter

MAX_LORAS = 3
MAX_LORA_RANK = 16
PROMPT_LENS = [7, 11, 5, 9]
NUM_TOKENS = 40
# Each prompt's adapter: name, or None for the base model.
PROMPT_ADAPTERS = ["all-r8", None, "some-r16-rs", "all-r8"]
ADAPTERS = {
    "all-r8": peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_MODULES), init_lora_weights=False),
    "some-r16-rs": peft.LoraConfig(
        r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    ),
}
SLOTS = {"some-r16-rs": 0, "all-r8": 2}  # slot 1 stays empty
set_slot_jit = jax.jit(set_slot)  # one program for every slot, as the runner's


def save_adapters(base_dir, root) -> dict[str, str]:
    """Each adapter of ``ADAPTERS`` on the base model, seeded, saved by PEFT; name -> directory."""
    paths = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():  # PEFT's B starts small: make each adapter move the logits well past the tolerance
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0.0, 0.05)
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
    return paths


def peft_logits(base_dir, adapter_paths: dict[str, str], prompts: list[list[int]]) -> list[np.ndarray]:
    """PEFT's float32 logits of each prompt under its adapter of ``PROMPT_ADAPTERS`` (run one at a time)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    names = list(adapter_paths)
    model = peft.PeftModel.from_pretrained(base, adapter_paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_paths[name], adapter_name=name)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt, name in zip(prompts, PROMPT_ADAPTERS, strict=True):
            ids = torch.tensor([prompt])
            if name is None:
                with model.disable_adapter():
                    out.append(model(ids).logits[0].numpy())
            else:
                model.set_adapter(name)
                out.append(model(ids).logits[0].numpy())
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoints(tmp_path_factory, request):
    """A tiny base model (Llama, or Qwen2 with its q/k/v biases) and the adapters of ``ADAPTERS`` on it."""
    CompileCounter.install()
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    save_tiny_hf_model(request.param, root / "base")
    return root / "base", save_adapters(root / "base", root)


def lora_step(model):
    """The model as the runner runs it, with a LoRA batch as an argument: logits of every token."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, input_ids, positions, kv_caches, metadata, lora):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(input_ids, positions, kv_caches, metadata, lora=lora)
        return m.compute_logits(hidden)

    return step, state


def step_inputs(base_dir, seed: int):
    """The model with empty LoRA slots (``add_lora_columns``), its jitted step, and the step's arguments but
    the LoRA batch over ``PROMPT_LENS`` random prompts: the parameters (whose kernels carry the slots' A)
    first."""
    model, config = load_model(base_dir)
    weights = LoRAWeights.zeros(config.num_layers, config.projection_shapes(), MAX_LORAS, MAX_LORA_RANK, jnp.float32)
    add_lora_columns(model, weights)
    prompts = random_prompts(config.vocab_size, PROMPT_LENS, seed=seed)
    metadata, positions = packed_metadata(
        PROMPT_LENS, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_tokens=NUM_TOKENS
    )
    step, state = lora_step(model)
    caches = random_caches(config, jnp.float32, 2)
    return config, weights, step, prompts, [state, pack(prompts, NUM_TOKENS), jnp.asarray(positions), caches, metadata]


def load_slot(args: list, weights: LoRAWeights, slot: int, adapter) -> LoRAWeights:
    """Put ``adapter`` in ``slot``: its A into the parameters of ``args[0]`` (in place of the list), its B
    into the slots' B returned."""
    leaves, treedef = jax.tree.flatten(args[0])
    index = lora_kernel_leaves(args[0])
    kernels = {key: leaves[i] for key, i in index.items()}
    kernels, weights = set_slot_jit(kernels, weights, jnp.int32(slot), *adapter_arrays(adapter.weights, weights))
    for key, i in index.items():
        leaves[i] = kernels[key]
    args[0] = jax.tree.unflatten(treedef, leaves)
    return weights


def token_slots(adapters: list[str | None]) -> jax.Array:
    slots = np.full(NUM_TOKENS, -1, np.int32)
    starts = np.cumsum([0, *PROMPT_LENS])
    for start, end, name in zip(starts[:-1], starts[1:], adapters, strict=True):
        slots[start:end] = -1 if name is None else SLOTS[name]
    return jnp.asarray(slots)


def test_prompt_logits_match_peft_per_adapter(checkpoints):
    base_dir, adapter_paths = checkpoints
    config, weights, step, prompts, args = step_inputs(base_dir, seed=3)
    for name, slot in SLOTS.items():
        weights = load_slot(args, weights, slot, read_lora_adapter(name, adapter_paths[name], config, MAX_LORA_RANK))

    logits = np.asarray(step(*args, LoRABatch(weights, token_slots(PROMPT_ADAPTERS))))
    compiled = CompileCounter.count()
    base_logits = np.asarray(step(*args, LoRABatch(weights, token_slots([None] * len(PROMPT_LENS)))))
    assert CompileCounter.count() == compiled  # one program for any assignment of adapters to tokens

    refs = peft_logits(base_dir, adapter_paths, prompts)
    starts = np.cumsum([0, *PROMPT_LENS])
    for i, (ref, name) in enumerate(zip(refs, PROMPT_ADAPTERS, strict=True)):
        ours = logits[starts[i] : starts[i + 1]]
        assert rel_err(ours, ref) < 1e-4, (i, name, rel_err(ours, ref))
        base = base_logits[starts[i] : starts[i + 1]]
        moved = rel_err(base, ref)
        assert (moved < 1e-4) if name is None else (moved > 1e-2), (i, name, moved)  # the adapters matter


def test_swapping_adapters_compiles_nothing(checkpoints):
    """Setting a slot is one program for every slot; the step takes new weights without compiling."""
    base_dir, adapter_paths = checkpoints
    config, weights, step, _, args = step_inputs(base_dir, seed=4)
    slots = token_slots(PROMPT_ADAPTERS)
    adapters = [read_lora_adapter(name, path, config, MAX_LORA_RANK) for name, path in adapter_paths.items()]
    weights = load_slot(args, weights, 0, adapters[0])  # warm-up
    step(*args, LoRABatch(weights, slots))
    compiled = CompileCounter.count()
    outputs = []
    for adapter in adapters:
        for slot in range(MAX_LORAS):
            weights = load_slot(args, weights, slot, adapter)
        outputs.append(np.asarray(step(*args, LoRABatch(weights, slots))))
    assert CompileCounter.count() == compiled
    assert rel_err(outputs[0], outputs[1]) > 1e-2  # the swap took effect


def test_random_adapter_loads_in_peft_and_matches(checkpoints, tmp_path):
    """A random adapter written for a model (as the built-in models get theirs) is one PEFT loads, and the
    model with it in a slot gives PEFT's logits."""
    base_dir, _ = checkpoints
    config, weights, step, prompts, args = step_inputs(base_dir, seed=5)
    path = save_random_lora_adapter(tmp_path / "random", config, rank=8, target_modules=["q_proj", "up_proj"], seed=7)
    weights = load_slot(args, weights, 1, read_lora_adapter("random", path, config, MAX_LORA_RANK))
    logits = np.asarray(step(*args, LoRABatch(weights, jnp.where(jnp.arange(NUM_TOKENS) < sum(PROMPT_LENS), 1, -1))))

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(base, str(path)).eval()
    with torch.no_grad():
        refs = [peft_model(torch.tensor([p])).logits[0].numpy() for p in prompts]
        with peft_model.disable_adapter():
            base_ref = peft_model(torch.tensor([prompts[0]])).logits[0].numpy()
    assert rel_err(logits[: sum(PROMPT_LENS)], np.concatenate(refs)) < 1e-4
    assert rel_err(refs[0], base_ref) > 1e-2  # the adapter moves the logits
