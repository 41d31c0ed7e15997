"""LoRA's part in a request's life (engine/hooks.py): its adapter is read when the request is added (a directory
that cannot be served refuses that request alone), held while it runs, let go when it ends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.engine.hooks import RequestHooks
from tokenmill.errors import InvalidRequest

if TYPE_CHECKING:
    from tokenmill.engine.lora_pool import LoRAPool
    from tokenmill.engine.messages import AddRequest
    from tokenmill.request import Request


class LoRAHooks(RequestHooks):
    def __init__(self, pool: LoRAPool | None):
        self.pool = pool
        self.adapter_of: dict[str, str] = {}  # sequence id -> its adapter's name

    def on_add(self, request: Request, msg: AddRequest) -> bool:
        lora = request.lora_request
        if lora is None:
            return False
        if self.pool is None:
            raise InvalidRequest(f"LoRA adapter {lora.lora_name!r} asked for, but this engine runs without "
                                 "--enable-lora", param="model")
        self.pool.acquire(lora)
        self.adapter_of[request.request_id] = lora.lora_name
        return False

    def on_release(self, request_id: str) -> None:
        name = self.adapter_of.pop(request_id, None)
        if name is not None:
            self.pool.release(name)

    def unload(self, name: str) -> None:
        if self.pool is not None:
            self.pool.unload(name)

    @property
    def allows_runs(self) -> bool:  # a multi-step run is the base model's C++ decode: no adapter in it
        return not self.adapter_of

    def check_idle(self) -> None:
        assert not self.adapter_of, f"adapters still held for {sorted(self.adapter_of)}"
        assert self.pool is None or not self.pool.users, f"adapter users left: {dict(self.pool.users)}"
