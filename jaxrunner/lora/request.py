"""vLLM's ``LoRARequest``: which adapter a request runs with."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``) at ``lora_path``.

    ``lora_int_id`` (positive) identifies the adapter across requests, as in vLLM:
    requests with the same id share its device slot and their prefix-cache blocks;
    different ids never share KV blocks.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string; got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest.lora_int_id must be a positive integer (0 is the base model); got {self.lora_int_id!r}."
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's directory (PEFT's "
                f"save_pretrained output); got {self.lora_path!r}."
            )

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of ``lora_path``."""
        return self.lora_path
