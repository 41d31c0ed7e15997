"""Adapters by name: the registry of the LoRA adapters this server serves (--lora-modules at start, and vLLM's
POST /v1/load_lora_adapter / /v1/unload_lora_adapter behind the admin key), which a request picks with its `model`.

An adapter is checked here before it is accepted (its config, and every tensor's shape against the base model's
projections from the safetensors header: lora/adapter.py check_adapter), so a bad directory is a 400 at load time,
not a failure at some later request. The engine reads the weights when the first request for it arrives.
"""

from __future__ import annotations

import itertools
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import ConfigError, InvalidRequest
from tokenmill.lora.adapter import check_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.server.errors import NotFound
from tokenmill.server.json_body import parse_json

log = logging.getLogger("tokenmill")


class LoRARegistry:
    """Adapter name -> its LoRARequest. Names are unique across the base model's served names and the adapters."""

    def __init__(self, engine: AsyncEngine, base_names: list[str]):
        self.engine, self.base_names = engine, base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        info = self.engine.info
        if info.lora_projections is None:
            raise InvalidRequest("this server serves no LoRA adapters; start it with --enable-lora", param="lora_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequest("give lora_name and lora_path, both non-empty strings", param="lora_name")
        if name in self.base_names or name in self.adapters:
            raise InvalidRequest(f"the name {name!r} is already served; unload it first or pick another",
                                 param="lora_name")
        check_adapter(path, info.lora_projections, info.num_layers, info.max_lora_rank)
        lora = self.adapters[name] = LoRARequest(name, next(self._ids), path)
        log.info("LoRA adapter %s added from %s", name, path)
        return lora

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise NotFound(f"no LoRA adapter {name!r} is loaded", param="lora_name")
        self.engine.unload_lora(name)
        log.info("LoRA adapter %s removed", name)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules entries, NAME=PATH or vLLM's JSON form {"name": ..., "path": ...}, as (name, path)."""
    out = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                out.append((spec["name"], spec["path"]))
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--lora-modules {value!r}: the JSON form is {{\"name\": ..., \"path\": ...}}") \
                    from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {value!r}: expected NAME=PATH (a PEFT adapter directory)")
        out.append((name, path))
    return out


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    async def body_of(request: Request, fields: tuple[str, ...]) -> dict:
        body = parse_json(await request.body(), request.headers.get("content-type"))
        unknown = sorted(set(body) - set(fields) - {"lora_int_id", "load_inplace"})
        if unknown:
            raise InvalidRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; the body is "
                                 f"{{{', '.join(repr(f) for f in fields)}}}", param=unknown[0])
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await body_of(request, ("lora_name", "lora_path"))
        lora = registry.add(body.get("lora_name"), body.get("lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await body_of(request, ("lora_name",))
        name = body.get("lora_name")
        registry.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
