"""Builds a ``CausalLM`` from a HuggingFace model directory, or with random weights.

The module is first built abstractly (shapes only, no memory), then each
parameter is filled from the checkpoint, one tensor at a time, straight into
its sharding on the model's mesh: each device reads only its slice of the
memory-mapped tensor, so no device ever holds a whole sharded weight.
Checkpoint names are HF's: our parameter path joined with dots, with a
Linear's ``kernel`` (``[in, out]``, HF's ``weight`` transposed) and an Embed's
``embedding`` both called ``weight``. A merged projection's parameter
(``qkv_proj``, ``gate_up_proj``) is assembled from its parts' tensors
(``q_proj``, ``k_proj``, ``v_proj``...), each device reading its slice of each;
a mixture-of-experts layer's stacked experts from one tensor per expert and part.
A family whose checkpoint names tensors otherwise (Phi-3's fused projections,
Mixtral's experts) has them renamed or cut first (``registry.Architecture``).
An attention layer's KV cache scales (``KVScale``) come from the tensors vLLM
reads for them (:data:`KV_SCALE_NAMES`), else are 1.0.

A Linear the model holds in FP8 (``models/quantization.py``) reads HF's ``weight``
(e4m3, ``[out, in]``: no transpose), ``weight_scale`` (one value, or one per
output: repeated over the outputs of its part) and ``input_scale`` (a merged
projection's inputs are shared: the largest of its parts'); a checkpoint weight not
in FP8 is quantized as it loads, per output (``LLM(quantization="fp8")``).
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from os import PathLike
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx
from jax.sharding import Mesh

from jaxrunner.config import ParallelConfig
from jaxrunner.models.converted import converted_quantization, is_converted, restore_converted
from jaxrunner.models.eagle import EagleHead
from jaxrunner.models.moe import EXPERT_PARTS, Experts
from jaxrunner.models.partitioning import logical_axes, param_sharding, param_shardings
from jaxrunner.models.quantization import on_load_fp8
from jaxrunner.models.registry import TensorViews, architecture, tensors_as_named
from jaxrunner.models.safetensors_io import (
    CONFIG_FILE,
    CheckpointError,
    checkpoint_files,
    iter_tensors,
    read_json_object,
)
from jaxrunner.models.transformer import CausalLM, Fp8Weights, KVScale, MergedProjection, TransformerConfig
from jaxrunner.ops.fp8_matmul import quantize_weight
from jaxrunner.ops.kv_write import is_fp8
from jaxrunner.sharding import make_mesh

_HF_LEAF_NAMES = {"kernel": "weight", "embedding": "weight"}
_MERGED_LEAVES = ("kernel", "bias", "weight", "weight_scale", "input_scale")
_FP8_SCALES = (".weight_scale", ".input_scale")
_UNQUANTIZED = (
    "but the model holds this module unquantized: the checkpoint's quantization_config leaves it out (its "
    "ignore list names it), or there is none"
)
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
"""ModelOpt's quantization file beside ``config.json`` (read where ``config.json`` has no ``quantization_config``)."""
QUANTIZATION_NAMES = ("fp8", "compressed-tensors", "modelopt")
"""``LLM(quantization=...)``'s values (vLLM's names): ``"fp8"`` quantizes a checkpoint without FP8 weights as it
loads; the others, and ``"fp8"``, also name the format of a checkpoint that has them."""
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints saved

KV_SCALE_NAMES = {
    "k_scale": ("k_scale",),
    "v_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),  # older checkpoints: one scale for both
    "k_proj.output_scale": ("k_scale",),  # compressed-tensors, Quark
    "v_proj.output_scale": ("v_scale",),
    "k_proj.k_scale": ("k_scale",),  # ModelOpt
    "v_proj.v_scale": ("v_scale",),
}
"""Checkpoint names of an attention layer's KV cache scales, after its ``self_attn``, and which of its
scales each sets: vLLM's ``maybe_remap_kv_scale_name`` and its quantization configs' ``get_cache_scale``."""


def load_model(
    model_dir: str | PathLike,
    *,
    dtype="float32",
    param_dtype=None,
    mesh: Mesh | None = None,
    max_model_len: int | None = None,
    quantization: str | None = None,
) -> tuple[CausalLM, TransformerConfig]:
    """Loads ``config.json`` and the safetensors weights of a local HF model directory.

    ``dtype`` is the compute dtype, ``param_dtype`` the weights' (default ``dtype``);
    both accept names like ``"bfloat16"`` or jnp dtypes. ``mesh`` (default: the first
    device) is where the weights go, split over its ``model`` axis. ``max_model_len``
    (None: the model's positions) is the length served, which picks LongRoPE's
    factors (``models/rope.py``). Raises ``ValueError``
    for a layout the mesh cannot take, and ``CheckpointError`` (a ``ValueError``) naming
    the file at fault for a config.json or index that cannot be read or is not supported
    (an architecture, a RoPE type, a quantization format), and for weights that do not fit.
    ``quantization`` is vLLM's: ``"fp8"`` quantizes the decoder's Linears to FP8 as they load
    where the checkpoint has no FP8 weights; a checkpoint's own format may be named too.
    A converted directory (``models/converted.py``) is restored from its orbax state instead
    of its safetensors.
    """
    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    with _naming(model_dir / CONFIG_FILE):
        arch = architecture(hf_config)
        config = TransformerConfig.from_hf(hf_config, max_model_len)
        if is_converted(model_dir):
            config = dataclasses.replace(config, quantization=converted_quantization(model_dir))
        config = with_quantization(config, quantization)
    dtype = jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    mesh = mesh or make_mesh(ParallelConfig())
    cls = arch.model_class
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0), mesh=mesh))
    if is_converted(model_dir):
        return restore_converted(model, model_dir, mesh), config
    _fill_params(model, model_dir, mesh, arch.tensor_views)
    return model, config


def with_quantization(config: TransformerConfig, quantization: str | None) -> TransformerConfig:
    """``config`` with ``LLM(quantization=...)`` applied: ``"fp8"`` on a model without FP8 weights gives it
    on-load FP8; a name other than the checkpoint's own format is refused (as vLLM does)."""
    if quantization is None:
        return config
    if quantization not in QUANTIZATION_NAMES:
        raise ValueError(
            f"quantization {quantization!r} is not supported; jaxrunner runs {', '.join(QUANTIZATION_NAMES)}"
        )
    held = config.quantization
    if held is None:
        if quantization != "fp8":
            raise ValueError(
                f"quantization={quantization!r} names a checkpoint format, but this checkpoint has no "
                "quantization_config: pass quantization='fp8' to quantize it as it loads"
            )
        return dataclasses.replace(config, quantization=on_load_fp8())
    if quantization not in ("fp8", held.method):
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's quantization_config ({held.method!r}): "
            f"pass quantization={held.method!r}, or none"
        )
    return config


def load_config(model_dir: str | PathLike, max_model_len: int | None = None) -> TransformerConfig:
    """The model configuration of a local HF model directory's ``config.json`` (no weights read)."""
    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    with _naming(model_dir / CONFIG_FILE):
        architecture(hf_config)  # an architecture we serve
        return TransformerConfig.from_hf(hf_config, max_model_len)


def load_eagle_head(model_dir: str | PathLike, *, dtype="float32", mesh: Mesh | None = None) -> EagleHead:
    """An EAGLE draft head from a local checkpoint (``config.json`` of its decoder layers, safetensors)."""
    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    with _naming(model_dir / CONFIG_FILE):
        config = TransformerConfig.from_hf(hf_config)
    dtype = jnp.dtype(dtype)
    mesh = mesh or make_mesh(ParallelConfig())
    head = nnx.eval_shape(lambda: EagleHead(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), mesh=mesh))
    _fill_params(head, model_dir, mesh)
    return head


def read_hf_config(model_dir: Path) -> transformers.PretrainedConfig:
    """``model_dir``'s config.json as transformers reads it; a missing directory or file, or one that
    does not parse, raises ``CheckpointError`` naming it."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: no such checkpoint directory")
    read_json_object(model_dir / CONFIG_FILE)  # our own reading names the file; transformers' may not
    with _naming(model_dir / CONFIG_FILE):
        hf_config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if (model_dir / HF_QUANT_CONFIG_FILE).is_file() and not getattr(hf_config, "quantization_config", None):
        hf_config.quantization_config = {
            "quant_method": "modelopt",
            **read_json_object(model_dir / HF_QUANT_CONFIG_FILE),
        }
    return hf_config


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Re-raises an error from reading ``path`` as a ``CheckpointError`` that starts with the path."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def init_random_model(
    config: TransformerConfig, *, dtype="float32", param_dtype=None, seed: int = 0, mesh: Mesh | None = None
) -> CausalLM:
    """A ``CausalLM`` with Flax's default random initialisation, for benchmarks and tests.

    The initialisation runs under jit with each parameter's sharding on ``mesh``
    (default: the first device) as its output sharding, so every device computes
    only its own shard; the values are the same for any mesh.
    """
    dtype = jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    graphdef, init = _random_init(config, dtype, param_dtype, mesh or make_mesh(ParallelConfig()))
    return nnx.merge(graphdef, init(jax.random.key(seed)))


@functools.cache
def _random_init(
    config: TransformerConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, mesh: Mesh
) -> tuple[nnx.GraphDef, Callable[[jax.Array], nnx.State]]:
    """The model's graph and its parameters' initialisation from a key, jitted once per model and mesh."""
    build = lambda key: CausalLM(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(key), mesh=mesh)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(jax.random.key(0))))
    return graphdef, jax.jit(lambda key: nnx.state(build(key)), out_shardings=param_shardings(mesh, abstract))


def hf_name(path: tuple) -> str:
    """The HF checkpoint name of the parameter at ``path`` in a ``CausalLM``."""
    *parents, leaf = map(str, path)
    return ".".join([*parents, _HF_LEAF_NAMES.get(leaf, leaf)])


def hf_parts(model: nnx.Module) -> dict[tuple, list[tuple[str, int | None]]]:
    """For each parameter path, the HF tensors it is made of: ``(name, slots)``, slots None for a whole tensor.

    Stacked experts list every expert's tensors in expert order (``moe.EXPERT_PARTS`` each).
    """
    parts = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Experts):
            num_experts = node.down_proj.get_value().shape[0]
            for leaf, expert_parts in EXPERT_PARTS.items():
                parts[(*path, leaf)] = [
                    (hf_name((*path, str(e), part, "kernel")), slots)
                    for e in range(num_experts)
                    for part, slots in expert_parts
                ]
        elif isinstance(node, MergedProjection):
            for leaf in _MERGED_LEAVES:
                if getattr(node, leaf) is not None:
                    parts[(*path, leaf)] = [(hf_name((*path[:-1], part, leaf)), n) for part, n in node.parts]
        elif isinstance(node, nnx.Param) and path not in parts:
            parts[path] = [(hf_name(path), None)]
    return parts


def hf_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as HF checkpoint tensors (merged projections split into their parts)."""
    tensors = {}
    nodes = dict(nnx.iter_graph(model))
    for path, sources in hf_parts(model).items():
        value = np.asarray(nodes[path].get_value())
        is_kernel = path[-1] == "kernel"
        if isinstance(nodes[path[:-1]], Experts):
            per_expert = len(EXPERT_PARTS[path[-1]])
            for e, expert in enumerate(value):
                for (name, _), piece in zip(sources[e * per_expert : (e + 1) * per_expert], _expert_pieces(expert)):
                    tensors[name] = np.ascontiguousarray(piece.reshape(piece.shape[0], -1).T)
            continue
        if sources[0][1] is None:
            tensors[sources[0][0]] = np.ascontiguousarray(value.T if is_kernel else value)
            continue
        if path[-1] == "input_scale":  # one scale the parts share
            tensors.update({name: value for name, _ in sources})
            continue
        slot_axis = -3 if path[-1] == "weight" else -2
        pieces = np.split(value, nodes[path[:-1]].split_points, axis=slot_axis)  # the MergedProjection's parts
        for (name, _), piece in zip(sources, pieces):
            if is_kernel:
                tensors[name] = np.ascontiguousarray(piece.reshape(piece.shape[0], -1).T)
            else:  # a bias or weight scale [out], an FP8 weight [out, in]
                tensors[name] = np.ascontiguousarray(
                    piece.reshape(-1, *piece.shape[len(piece.shape) + slot_axis + 2 :])
                )
    return tensors


def _expert_pieces(expert: np.ndarray) -> list[np.ndarray]:
    """One expert's ``[in, slots, width]`` (or ``[in, out]``) parameter cut into its parts, one slot each."""
    return [expert] if expert.ndim == 2 else np.split(expert, expert.shape[-2], axis=-2)


def _kv_scale_sources(model: nnx.Module) -> dict[str, list[tuple]]:
    """Each checkpoint name of a KV cache scale, and the paths of the ``KVScale`` variables it sets."""
    sources: dict[str, list[tuple]] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, KVScale):
            for suffix, scales in KV_SCALE_NAMES.items():
                if path[-1] in scales:
                    sources.setdefault(hf_name((*path[:-1], suffix)), []).append(path)
    return sources


def _kv_scale_value(name: str, array: np.ndarray, file: Path) -> float:
    """A checkpoint's KV cache scale as a float: one positive finite value (per layer, as vLLM reads it)."""
    if array.size != 1:
        raise CheckpointError(
            f"{file}: tensor {name!r} has shape {array.shape}; a KV cache scale is one value per layer "
            "(per-head or per-channel scales are not supported)"
        )
    value = float(array.reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{file}: tensor {name!r} is {value}; a KV cache scale must be positive and finite")
    return value


def _fill_kv_scales(model: nnx.Module, loaded: dict[tuple, float], mesh: Mesh) -> None:
    """Sets every ``KVScale`` of the abstract ``model`` to its ``loaded`` value, else 1.0, on every device."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, KVScale):
            node.set_value(jax.device_put(np.float32(loaded.get(path, 1.0)), param_sharding(mesh, path)))


def _fill_params(
    model: CausalLM | EagleHead, model_dir: Path, mesh: Mesh, tensor_views: TensorViews = tensors_as_named
) -> None:
    """Sets every parameter of the abstract ``model`` from the checkpoint, checking names and shapes,
    and its KV cache scales (1.0 where the checkpoint has none).

    Each checkpoint tensor is read through ``tensor_views`` (its family's names). Each
    parameter lands in its sharding on ``mesh`` (the model's), in the dtype the model
    holds it in; a padded vocabulary's extra rows are zeros.
    """
    nodes = dict(nnx.iter_graph(model))
    params = {path: var for path, var in nodes.items() if isinstance(var, nnx.Param)}
    sources = hf_parts(model)
    owner = {name: path for path, parts in sources.items() for name, _ in parts}
    fp8_weights = {
        name for name, path in owner.items() if path[-1] == "weight" and isinstance(nodes[path[:-1]], Fp8Weights)
    }
    scale_sources = _kv_scale_sources(model)
    scales: dict[tuple, float] = {}
    scale_set_by: dict[tuple, str] = {}
    received: dict[tuple, dict[str, tuple[np.ndarray, Path]]] = {}
    loaded_from: dict[str, Path] = {}
    files = checkpoint_files(model_dir)
    for file in files:
        for name, array in _quantized_on_load(_viewed_tensors(file, tensor_views, model.config), fp8_weights):
            if name.endswith(_IGNORED_SUFFIXES) or name in getattr(model, "ignored_tensors", ()):
                continue
            if name == "lm_head.weight" and model.lm_head is None:
                continue
            if name in loaded_from:
                raise CheckpointError(f"{file}: tensor {name!r} was already loaded from {loaded_from[name]}")
            if name in scale_sources:
                loaded_from[name] = file
                for path in scale_sources[name]:
                    if path in scale_set_by:
                        raise CheckpointError(
                            f"{file}: tensor {name!r} sets a KV cache scale that {scale_set_by[path]!r} set "
                            "already; a checkpoint must give each layer's scale once"
                        )
                    scale_set_by[path] = name
                    scales[path] = _kv_scale_value(name, array, file)
                continue
            module = name.rsplit(".", 1)[0]
            if name not in owner:
                if name.endswith(_FP8_SCALES) and f"{module}.weight" in owner:
                    raise CheckpointError(f"{file}: tensor {name!r} is an FP8 scale, {_UNQUANTIZED}")
                raise CheckpointError(f"{file}: unexpected tensor {name!r}; the model has no such parameter")
            loaded_from[name] = file
            path = owner[name]
            var, sharding = params[path], param_sharding(mesh, path)
            shape, dtype = var.get_value().shape, var.get_value().dtype
            if is_fp8(array.dtype) and not is_fp8(dtype):
                raise CheckpointError(f"{file}: tensor {name!r} is FP8 ({array.dtype}), {_UNQUANTIZED}")
            if path[-1] == "weight_scale":
                slots = dict(sources[path])[name]
                outputs = math.prod(shape) if slots is None else math.prod(shape) // shape[-2] * slots
                array = _fp8_scale(name, array, outputs, file)
            elif path[-1] == "input_scale":
                array = _fp8_scale(name, array, 1, file)
            received.setdefault(path, {})[name] = (array, file)
            if len(received[path]) < len(sources[path]):
                continue  # a merged parameter waits for its other parts
            if isinstance(nodes[path[:-1]], Experts):
                parts = [(n, *received[path][n], slots) for n, slots in sources[path]]
                var.set_value(_to_expert_param(parts, path, shape, dtype, sharding))
            elif path[-1] == "input_scale":  # the inputs a merged projection's parts share: one scale
                largest = max(float(received[path][n][0].reshape(())) for n, _ in sources[path])
                var.set_value(jax.device_put(np.float32(largest), sharding))
            elif sources[path][0][1] is None:
                var.set_value(_to_param(array, path, shape, model.config, dtype, sharding, file))
            else:
                parts = [(n, *received[path][n], slots) for n, slots in sources[path] if slots is not None]
                var.set_value(_to_merged_param(parts, path, shape, dtype, sharding))
            del received[path]
    _fill_kv_scales(model, scales, mesh)
    missing = sorted(name for name in owner if name not in loaded_from)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{model_dir}: tensor {missing[0]!r}{more} is missing from {', '.join(f.name for f in files)}"
        )


def _quantized_on_load(
    tensors: Iterator[tuple[str, np.ndarray]], fp8_weights: set[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """``tensors``, each weight the model holds in FP8 but the checkpoint does not quantized per output as it
    passes (its ``weight_scale`` after it)."""
    for name, array in tensors:
        if name not in fp8_weights or is_fp8(array.dtype):
            yield name, array
            continue
        values, scale = _quantize_weight(jnp.asarray(array))
        yield name, np.asarray(values)
        yield name.removesuffix("weight") + "weight_scale", np.asarray(scale)


_quantize_weight = jax.jit(quantize_weight)


def _fp8_scale(name: str, array: np.ndarray, outputs: int, file: Path) -> np.ndarray:
    """A checkpoint's ``weight_scale`` as ``[outputs]`` float32 (one value per tensor repeated, or one per
    output), or its ``input_scale`` (``outputs`` 1) as a scalar; anything else (block or group scales) refused."""
    values = np.asarray(array, np.float32).reshape(-1)
    if values.size not in (1, outputs):
        kind = "a weight scale per tensor or per output" if outputs > 1 else "one input scale per tensor"
        raise CheckpointError(
            f"{file}: tensor {name!r} has shape {array.shape}; jaxrunner reads {kind} ({outputs} outputs here)"
        )
    if not np.all(np.isfinite(values) & (values > 0)):
        raise CheckpointError(f"{file}: tensor {name!r} has a scale that is not positive and finite")
    return np.broadcast_to(values, (outputs,)) if outputs > 1 else values.reshape(())


def _viewed_tensors(
    file: Path, tensor_views: TensorViews, config: TransformerConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """``file``'s tensors through ``tensor_views``; a tensor the views refuse raises ``CheckpointError``."""
    for name, array in iter_tensors(file):
        try:
            yield from tensor_views(name, array, config)
        except ValueError as e:
            raise CheckpointError(f"{file}: {e}") from e


def _to_expert_param(
    parts: list[tuple[str, np.ndarray, Path, int | None]],
    path: tuple,
    shape: tuple[int, ...],
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """Stacked experts' parameter of ``shape`` (``[experts, in, slots, width]`` or ``[experts, in, out]``)
    from every expert's checkpoint tensors (in expert order, ``len(parts) / experts`` each), shape-checked;
    each device copies only its slice of each."""
    per_expert = len(parts) // shape[0]
    views = []
    for name, array, file, slots in parts:
        part_shape = shape[1:] if slots is None else (shape[1], slots, shape[-1])
        hf_shape = (math.prod(part_shape[1:]), shape[1])
        if array.shape != hf_shape:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {array.shape}, the model expects {hf_shape}")
        views.append(array.T.reshape(part_shape))
    experts = [views[e * per_expert : (e + 1) * per_expert] for e in range(shape[0])]

    def read(index: tuple[slice, ...]) -> np.ndarray:
        inner = index[1:]
        shards = []
        for expert in experts[index[0]]:
            whole = expert[0] if len(expert) == 1 else np.concatenate(expert, axis=-2)
            shards.append(np.asarray(whole[inner], dtype=dtype))
        return np.stack(shards)

    return jax.make_array_from_callback(shape, sharding, read)  # pyright: ignore[reportArgumentType]


def _to_merged_param(
    parts: list[tuple[str, np.ndarray, Path, int]],
    path: tuple,
    shape: tuple[int, ...],
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """A merged projection's parameter of ``shape`` from its parts' checkpoint tensors (each filling
    ``slots`` of every group), shape-checked: a kernel ``[in, *groups, slots, width]``, an FP8 weight
    ``[*groups, slots, width, in]``, or a bias or weight scale ``[*groups, slots, width]``.

    Each part is viewed in the parameter's layout without a copy (HF's ``[out, in]``
    transposed for a kernel, its out axis split into groups, slots and width); each
    device then copies only its slice of each part.
    """
    leaf = path[-1]
    slot_axis = len(shape) - (3 if leaf == "weight" else 2)
    views = []
    for name, array, file, slots in parts:
        part_shape = (*shape[:slot_axis], slots, *shape[slot_axis + 1 :])
        if leaf == "kernel":
            hf_shape = (math.prod(part_shape[1:]), shape[0])
        elif leaf == "weight":
            hf_shape = (math.prod(part_shape[:-1]), shape[-1])
        else:
            hf_shape = (math.prod(part_shape),)
        if array.shape != hf_shape:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {array.shape}, the model expects {hf_shape}")
        views.append((array.T if leaf == "kernel" else array).reshape(part_shape))

    # The callback's index is typed Index | None, but jax asserts it is not None before each call.
    read = lambda index: _read_merged_shard(views, index, slot_axis, dtype)  # pyright: ignore[reportArgumentType]
    return jax.make_array_from_callback(shape, sharding, read)


def _read_merged_shard(views: list[np.ndarray], index: tuple[slice, ...], slot_axis: int, dtype) -> np.ndarray:
    """One device's shard of a merged parameter: its slice of every part, joined along the slots axis."""
    whole_slots = (*index[:slot_axis], slice(None), *index[slot_axis + 1 :])
    shard = np.concatenate([np.asarray(v[whole_slots], dtype=dtype) for v in views], axis=slot_axis)
    return shard[(*(slice(None),) * slot_axis, index[slot_axis])]


def _to_param(
    array: np.ndarray,
    path: tuple,
    shape: tuple[int, ...],
    config: TransformerConfig,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding,
    file: Path,
) -> jax.Array:
    """One checkpoint tensor as a parameter of ``shape`` in ``sharding``: shape-checked, transposed if a kernel.

    ``shape`` may be the checkpoint's padded along a vocabulary axis; the padding is zeros.
    Each device's shard is read from the memory map and cast on the host, alone.
    """
    is_kernel = path[-1] == "kernel"
    if is_kernel and array.ndim > 2:  # a convolution whose stride is its kernel (a patch embedding): a matmul
        array = array.reshape(array.shape[0], -1)
    axes = logical_axes(path) or (None,) * len(shape)
    unpadded = tuple(config.vocab_size if axis == "vocab" else n for axis, n in zip(axes, shape))
    hf_shape = unpadded[::-1] if is_kernel else unpadded
    if array.shape != hf_shape:
        raise CheckpointError(f"{file}: tensor {hf_name(path)!r} has shape {array.shape}, the model expects {hf_shape}")
    source = array.T if is_kernel else array
    # The callback's index is typed Index | None, but jax asserts it is not None before each call.
    read = lambda index: _read_shard(source, index, shape, dtype)  # pyright: ignore[reportArgumentType]
    return jax.make_array_from_callback(shape, sharding, read)


def _read_shard(source: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...], dtype) -> np.ndarray:
    """``source`` zero-padded to ``shape`` and cut at ``index``: one device's shard, in ``dtype``."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    shard = np.zeros([stop - start for start, stop in bounds], dtype)
    inside = tuple(slice(start, max(min(stop, n), start)) for (start, stop), n in zip(bounds, source.shape))
    shard[tuple(slice(0, s.stop - s.start) for s in inside)] = source[inside]
    return shard
