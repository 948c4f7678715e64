"""Builds a ``CausalLM`` from a HuggingFace model directory, or with random weights.

The module is first built abstractly (shapes only, no memory), then each
parameter is filled from the checkpoint, one tensor at a time. Checkpoint names
are HF's: our parameter path joined with dots, with a Linear's ``kernel``
(``[in, out]``, HF's ``weight`` transposed) and an Embed's ``embedding`` both
called ``weight``.
"""

from os import PathLike
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx

from jaxrunner.models.eagle import EagleHead
from jaxrunner.models.registry import model_class
from jaxrunner.models.safetensors_io import CheckpointError, checkpoint_files, iter_tensors
from jaxrunner.models.transformer import CausalLM, TransformerConfig

_HF_LEAF_NAMES = {"kernel": "weight", "embedding": "weight"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints saved


def load_model(
    model_dir: str | PathLike, *, dtype="float32", param_dtype=None
) -> tuple[CausalLM, TransformerConfig]:
    """Loads ``config.json`` and the safetensors weights of a local HF model directory.

    ``dtype`` is the compute dtype, ``param_dtype`` the weights' (default ``dtype``);
    both accept names like ``"bfloat16"`` or jnp dtypes. Raises ``ValueError`` for an
    unsupported architecture and ``CheckpointError`` for weights that do not fit.
    """
    model_dir = Path(model_dir)
    hf_config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cls = model_class(hf_config)
    config = TransformerConfig.from_hf(hf_config)
    dtype = jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    _fill_params(model, model_dir, param_dtype)
    return model, config


def load_eagle_head(model_dir: str | PathLike, *, dtype="float32") -> EagleHead:
    """An EAGLE draft head from a local checkpoint (``config.json`` of its decoder layers, safetensors)."""
    model_dir = Path(model_dir)
    hf_config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config = TransformerConfig.from_hf(hf_config)
    dtype = jnp.dtype(dtype)
    head = nnx.eval_shape(lambda: EagleHead(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    _fill_params(head, model_dir, dtype)
    return head


def init_random_model(config: TransformerConfig, *, dtype="float32", param_dtype=None, seed: int = 0) -> CausalLM:
    """A ``CausalLM`` with Flax's default random initialisation, for benchmarks and tests."""
    dtype = jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    return CausalLM(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed))


def hf_name(path: tuple) -> str:
    """The HF checkpoint name of the parameter at ``path`` in a ``CausalLM``."""
    *parents, leaf = path
    return ".".join([*map(str, parents), _HF_LEAF_NAMES.get(leaf, leaf)])


def _fill_params(model: CausalLM | EagleHead, model_dir: Path, param_dtype: jnp.dtype) -> None:
    """Sets every parameter of the abstract ``model`` from the checkpoint, checking names and shapes."""
    wanted = {hf_name(path): (path, var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
    loaded_from: dict[str, Path] = {}
    files = checkpoint_files(model_dir)
    for file in files:
        for name, array in iter_tensors(file):
            if name.endswith(_IGNORED_SUFFIXES) or name in getattr(model, "ignored_tensors", ()):
                continue
            if name == "lm_head.weight" and model.lm_head is None:
                continue
            if name in loaded_from:
                raise CheckpointError(f"{file}: tensor {name!r} was already loaded from {loaded_from[name]}")
            if name not in wanted:
                raise CheckpointError(f"{file}: unexpected tensor {name!r}; the model has no such parameter")
            path, var = wanted.pop(name)
            var.set_value(_to_param(array, path[-1] == "kernel", var.get_value().shape, param_dtype, name, file))
            loaded_from[name] = file
    if wanted:
        missing = sorted(wanted)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{model_dir}: tensor {missing[0]!r}{more} is missing from {', '.join(f.name for f in files)}"
        )


def _to_param(
    array: np.ndarray, is_kernel: bool, shape: tuple[int, ...], param_dtype: jnp.dtype, name: str, file: Path
) -> jnp.ndarray:
    """One checkpoint tensor as a device parameter: shape-checked, cast, transposed if a kernel."""
    hf_shape = shape[::-1] if is_kernel else shape
    if array.shape != hf_shape:
        raise CheckpointError(f"{file}: tensor {name!r} has shape {array.shape}, the model expects {hf_shape}")
    value = jnp.array(array, dtype=param_dtype)
    return value.T if is_kernel else value
