"""LoRA adapters over one base model: PEFT directories read and checked (adapter.py), the request field that names
one (request.py), and the engine's pool of adapter slots (model/lora.py holds the tensors, engine/lora_pool.py
which adapter sits in which slot)."""

from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
