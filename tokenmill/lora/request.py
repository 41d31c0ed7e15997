"""LoRARequest: which adapter a request runs through, with vLLM's field names so offline scripts carry over."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (what the API's `model` field says, and what its prefix-cache entries are kept under),
    a number unique per adapter (vLLM's `lora_int_id`; kept for compatibility) and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
