"""A model saved as the runner holds it, with orbax-checkpoint, and restored straight onto its devices.

Loading a HuggingFace checkpoint reads every safetensors tensor, merges q/k/v and
gate/up, pads the vocabulary for the mesh and places each shard. A converted
directory keeps the result instead: the model's state (merged projections, KV
cache scales, FP8 weights and their scales, each array in its sharding) as an
orbax checkpoint under ``state/``, the source's ``config.json`` and tokenizer
files, and :data:`MANIFEST_FILE` saying the dtypes, FP8 quantization and
tensor-parallel size it was held in (a model quantized as it loaded is restored
quantized: nothing is quantized again).
``load_model`` on such a directory builds the model's shapes from ``config.json``
and has orbax read each device's shards onto it: nothing is re-read from
safetensors, re-merged or re-padded. The directory is a model directory like any
other for ``LLM(model=...)``.
"""

from __future__ import annotations

import json
import shutil
from os import PathLike
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from jaxrunner.models.partitioning import param_sharding
from jaxrunner.models.quantization import Fp8Config
from jaxrunner.models.safetensors_io import INDEX_FILE, CheckpointError, read_json_object
from jaxrunner.models.transformer import CausalLM
from jaxrunner.sharding import padded_vocab_size, tensor_parallel_size

MANIFEST_FILE = "jaxrunner_converted.json"
STATE_DIR = "state"
FORMAT_VERSION = 1


def is_converted(model_dir: str | PathLike) -> bool:
    """Whether ``model_dir`` holds a converted model (:func:`save_converted`'s output)."""
    return (Path(model_dir) / MANIFEST_FILE).is_file()


def save_converted(state: nnx.State, model: CausalLM, source_dir: str | PathLike, out_dir: str | PathLike) -> None:
    """Writes ``state`` (``model``'s, as placed on its mesh) to ``out_dir``, with ``source_dir``'s config and
    tokenizer files and the manifest. ``out_dir`` must not exist yet."""
    source, out = Path(source_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new directory for the converted model")
    out.mkdir(parents=True)
    for item in source.iterdir():  # config.json, the tokenizer's files...: all but the weights
        if item.is_file() and item.suffix != ".safetensors" and item.name != INDEX_FILE:
            shutil.copy2(item, out / item.name)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((out / STATE_DIR).absolute(), state)
    checkpointer.wait_until_finished()
    manifest = dict(
        format_version=FORMAT_VERSION,
        dtype=jnp.dtype(model.dtype).name,
        param_dtype=jnp.dtype(model.model.embed_tokens.embedding.get_value().dtype).name,
        tensor_parallel_size=tensor_parallel_size(model.mesh),
        padded_vocab_size=model.model.embed_tokens.num_embeddings,
        quantization=None if model.config.quantization is None else model.config.quantization.as_dict(),
    )
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


def converted_quantization(model_dir: str | PathLike) -> Fp8Config | None:
    """The FP8 quantization a converted model was saved with (None: none)."""
    fields = read_json_object(Path(model_dir) / MANIFEST_FILE).get("quantization")
    return None if fields is None else Fp8Config.from_dict(fields)


def restore_converted(abstract: CausalLM, model_dir: str | PathLike, mesh: Mesh) -> CausalLM:
    """``abstract`` (the model's shapes, built for ``mesh``) with its state read from ``model_dir``, each
    array straight into its sharding. Refuses a directory saved in other dtypes or for a vocabulary padded
    otherwise (another tensor-parallel size that pads differently), saying what to pass."""
    model_dir = Path(model_dir)
    manifest = read_json_object(model_dir / MANIFEST_FILE)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{model_dir / MANIFEST_FILE}: format_version {manifest.get('format_version')!r}; this jaxrunner "
            f"reads {FORMAT_VERSION}: convert the model again"
        )
    dtype = jnp.dtype(abstract.dtype).name
    param_dtype = jnp.dtype(abstract.model.embed_tokens.embedding.get_value().dtype).name
    if (manifest["dtype"], manifest["param_dtype"]) != (dtype, param_dtype):
        raise CheckpointError(
            f"{model_dir}: converted with dtype {manifest['dtype']} and weights in {manifest['param_dtype']}, "
            f"loaded with {dtype} and {param_dtype}: pass dtype={manifest['dtype']!r}, or convert again"
        )
    padded = padded_vocab_size(abstract.config.vocab_size, tensor_parallel_size(mesh))
    if padded != manifest["padded_vocab_size"]:
        raise CheckpointError(
            f"{model_dir}: converted for tensor_parallel_size {manifest['tensor_parallel_size']} (vocabulary "
            f"padded to {manifest['padded_vocab_size']}), loaded with {tensor_parallel_size(mesh)} (padded to "
            f"{padded}): load with tensor_parallel_size={manifest['tensor_parallel_size']}, or convert again"
        )
    graphdef, state = nnx.split(abstract)

    def target(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        leaf = variable.get_value()
        return variable.replace(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param_sharding(mesh, path)))

    target_state = nnx.map_state(target, state)
    restored = ocp.StandardCheckpointer().restore((model_dir / STATE_DIR).absolute(), target_state)
    return nnx.merge(graphdef, restored)
