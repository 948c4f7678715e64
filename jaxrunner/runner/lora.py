"""LoRA adapters in the runner (vLLM's ``LoRAModelRunnerMixin``): device slots, each request's slot, the host's LRU.

On the device, ``max_loras`` slots of adapter weights: their A, columns of the
model's own projection kernels (``add_lora_columns``), which loading an adapter
rewrites in place (donated: the model is never held twice), and their B
(``LoRAWeights``), an argument of the forward programs that is never donated (so
it outlives any step cut short). Each request's slot is per-request device state
(``DeviceState.lora_slots``, written with the request's row), from which the
forward step computes each token's. On the host, ``LoRASlots`` keeps the slot
table and an LRU of adapters
read from disk (``max_cpu_loras``). A request joining with an adapter no slot
holds takes the least recently used slot that no running request uses, loaded by
one program for every slot; a slot whose last request leaves keeps its weights,
so an adapter that comes back before its slot is taken loads nothing.

The scheduler keeps the requests on the runner to at most ``max_loras``
distinct adapters (vLLM's rule); a request that would need one more is an error.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import numpy as np

from jaxrunner.config import LoRAConfig, RunnerConfig
from jaxrunner.interfaces import NewRequestData
from jaxrunner.lora.request import LoRARequest
from jaxrunner.models import TransformerConfig
from jaxrunner.models.lora import LoRAKernels, LoRAWeights, adapter_arrays
from jaxrunner.models.lora_adapter import LoRAAdapter, read_lora_adapter
from jaxrunner.runner.states import NO_LORA
from jaxrunner.spans import Spans

LORA_OFF = (
    "LoRA is off: pass enable_lora=True to LLM (RunnerConfig.lora_config=LoRAConfig(...) to the runner) "
    "to run requests with a lora_request, or send them without one."
)


def check_lora_support(config: RunnerConfig) -> None:
    """Refuse, before anything is built, what LoRA does not run with yet."""
    if config.lora_config is None:
        return
    if config.parallel_config.tensor_parallel_size > 1:
        raise ValueError(
            "LoRA adapters are not supported with tensor parallelism yet: "
            f"use tensor_parallel_size=1 (got {config.parallel_config.tensor_parallel_size}), or turn LoRA off."
        )
    if config.speculative_config is not None:
        raise ValueError(
            "LoRA adapters are not supported with speculative decoding yet "
            f"(method {config.speculative_config.method!r}): drop the speculative config, or turn LoRA off."
        )


def check_lora_model_support(config: RunnerConfig, arch: TransformerConfig) -> None:
    """Refuse, once the model is known, a model whose layers LoRA does not reach yet."""
    if config.lora_config is not None and arch.moe is not None:
        raise NotImplementedError(
            "LoRA adapters on a mixture-of-experts model are not supported yet: serve it without enable_lora."
        )
    if config.lora_config is not None and arch.quantization is not None:
        raise NotImplementedError(
            "LoRA adapters on FP8 weights are not supported yet: serve the bf16 checkpoint with enable_lora, "
            "or the FP8 one without."
        )


class AdapterCache:
    """Adapters read from disk, the ``capacity`` most recently used kept in host memory (``max_cpu_loras``)."""

    def __init__(self, capacity: int, arch: TransformerConfig, max_lora_rank: int):
        self.capacity = capacity
        self.arch = arch
        self.max_lora_rank = max_lora_rank
        self._adapters: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()

    def get(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The request's adapter, read unless kept; raises ``LoRAAdapterError`` naming a bad one."""
        key = lora_request.lora_int_id
        adapter = self._adapters.get(key)
        if adapter is None:
            adapter = read_lora_adapter(lora_request.lora_name, lora_request.lora_path, self.arch, self.max_lora_rank)
            self._adapters[key] = adapter
            if len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return adapter


class LoRASlots:
    """The device's adapter slots, which adapter each holds, and which running requests use each
    (a ``RequestFeatureState`` of the runner).

    ``weights`` are the slots' current B (of ``arch``'s projections, in ``dtype``,
    placed with ``sharding``), which the runner passes to its forward programs;
    ``param_leaves`` is the runner's list of parameter leaves, whose LoRA kernels
    (``kernel_leaves``: index by ``(layer, projection)``) hold the slots' A;
    ``load_program()`` gives the compiled program that sets one slot in both.
    """

    def __init__(
        self,
        weights: LoRAWeights,
        config: LoRAConfig,
        arch: TransformerConfig,
        param_leaves: list[jax.Array],
        kernel_leaves: dict[tuple[int, str], int],
        load_program: Callable[[], jax.stages.Compiled],
        spans: Spans,
    ):
        assert config.max_cpu_loras is not None  # LoRAConfig defaults it to max_loras
        self.max_loras = config.max_loras
        self.weights = weights
        self._param_leaves = param_leaves
        self._kernel_leaves = kernel_leaves
        self.adapters = AdapterCache(config.max_cpu_loras, arch, config.max_lora_rank)
        self._load_program = load_program
        self._spans = spans
        self._held: list[LoRARequest | None] = [None] * self.max_loras  # slot -> the adapter it holds
        self._request_slot: dict[str, int] = {}  # running request -> its adapter's slot
        self._users = [0] * self.max_loras  # slot -> running requests using it
        # Slots no running request uses, least recently used first (empty ones before any loaded).
        self._unused: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(self.max_loras))

    def slot_for(self, new_req: NewRequestData) -> int:
        """The slot of the request's adapter (``NO_LORA`` without one), loading the adapter if no slot holds it.
        The request's row carries it; ``add_request``, once the request has its row, keeps the slot for it."""
        lora_request = new_req.lora_request
        if lora_request is None:
            return NO_LORA
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"Request {new_req.req_id!r} has a lora_request of type {type(lora_request).__name__}; "
                "pass a jaxrunner.lora.LoRARequest."
            )
        slot = self.loaded.get(lora_request.lora_int_id)
        return self._load_adapter(new_req.req_id, lora_request) if slot is None else slot

    def add_request(self, new_req: NewRequestData, slot: int) -> None:
        """The request (in request slot ``slot``) uses its adapter's slot until it leaves the runner."""
        if new_req.lora_request is None:
            return
        lora_slot = self.loaded[new_req.lora_request.lora_int_id]
        self._unused.pop(lora_slot, None)
        self._users[lora_slot] += 1
        self._request_slot[new_req.req_id] = lora_slot

    def remove_request(self, req_id: str) -> None:
        """The request leaves the runner; its slot, once no running request uses it, may be taken (weights kept)."""
        slot = self._request_slot.pop(req_id, None)
        if slot is None:
            return
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._unused[slot] = None

    @property
    def num_unused_slots(self) -> int:
        """Slots no running request uses."""
        return len(self._unused)

    @property
    def kernels(self) -> LoRAKernels:
        """The parameters that carry the slots' A, by ``(layer, projection)``."""
        return {key: self._param_leaves[index] for key, index in self._kernel_leaves.items()}

    @property
    def loaded(self) -> dict[int, int]:
        """``lora_int_id`` -> slot of every adapter a slot holds."""
        return {held.lora_int_id: slot for slot, held in enumerate(self._held) if held is not None}

    def _load_adapter(self, req_id: str, lora_request: LoRARequest) -> int:
        """Load the adapter into the least recently used unused slot; the slot."""
        adapter = self.adapters.get(lora_request)  # a bad adapter is refused before any slot changes
        if not self._unused:
            in_use = sorted(f"{held.lora_name!r} (id {held.lora_int_id})" for held in self._held if held is not None)
            raise ValueError(
                f"Request {req_id!r} needs LoRA adapter {lora_request.lora_name!r} (id {lora_request.lora_int_id}), "
                f"but all {self.max_loras} LoRA slots hold adapters of running requests: {', '.join(in_use)}. "
                "The scheduler must keep the running requests to at most LoRAConfig.max_loras distinct adapters; "
                "raise max_loras or finish (or preempt) a request of another adapter first."
            )
        slot = next(iter(self._unused))
        with self._spans("load_lora"):
            a, b = adapter_arrays(adapter.weights, like=self.weights)
            with self._spans("program_call"):
                kernels, self.weights = self._load_program()(self.kernels, self.weights, np.int32(slot), a, b)
            for key, index in self._kernel_leaves.items():
                self._param_leaves[index] = kernels[key]
        self._held[slot] = lora_request  # evicting the adapter it held
        return slot
