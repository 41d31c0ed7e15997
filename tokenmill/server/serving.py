"""What every route of one app shares (server/app.py builds one per app and hands it to each routes_*.py): the engine
and its tokenizer, the settings, the served names and LoRA adapters, the prompt encoder; and the one way a generating
request is checked and queued, so /v1/completions and the chat path (chat_runs.py: chat completions, Messages,
Responses) refuse the same requests with the same errors, in the same order."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenmill.disagg.transfer import KVTransferParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.output_stream import OutputStream
from tokenmill.errors import ConfigError, InvalidRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import ModelNotFound
from tokenmill.server.json_body import parse_json, validate
from tokenmill.server.lora_routes import LoRARegistry
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.prompts import PromptEncoder
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.settings import ServerSettings
from tokenmill.server.token_text import TokenText

Prompts = list[tuple[str | None, list[int]]]  # (text when known, token ids), as the engine takes them


@dataclass
class Started:
    """A generating request queued: its id, the served model's name, its params and prompts, its output stream."""

    request_id: str
    model: str
    params: SamplingParams
    prompts: Prompts
    stream: OutputStream


class Serving:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.tok = engine.tokenizer
        self.info = engine.info
        self.names = list(dict.fromkeys(settings.served_model_names))
        self.token_text = TokenText(self.tok)
        self.encoder = PromptEncoder(self.tok)
        self.loras = LoRARegistry(engine, self.names)  # adapters a request may name as its model (lora_routes.py)
        for name, path in settings.lora_modules:
            try:
                self.loras.add(name, path)
            except InvalidRequest as e:
                raise ConfigError(f"--lora-modules {name}={path}: {e}") from None

    async def read(self, request: Request, model: type) -> Any:
        raw = await request.body()
        return validate(model, parse_json(raw, request.headers.get("content-type")))

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        params = req.to_params(self.info.vocab_size)
        self.settings.check_priority(params.priority)
        return params

    def check_runner_generates(self) -> None:  # (a base model's server: the engine refuses text requests itself)
        if self.settings.runner == "pooling":
            raise InvalidRequest("this server runs --runner pooling: it answers /v1/embeddings, not generation "
                                 "requests", param="model")

    def check_model(self, name: str | None) -> str:
        """The served name a request's `model` picks (None: the first); 404 naming what is served otherwise."""
        if name is None or name in self.names or name in self.loras.adapters:
            return name or self.names[0]
        served = self.names + list(self.loras.adapters)
        raise ModelNotFound(f"the model {name!r} does not exist; this server serves {', '.join(map(repr, served))}",
                            param="model")

    async def start(self, req: CompletionRequest | ChatCompletionRequest, arrival: float, kind: str,
                    encode: Callable[[str], Awaitable[Prompts]]) -> Started:
        """Check, encode and queue a generating request; the first failure is the error, in this order: the model's
        name, that this server generates, the sampling params, `encode(model)`'s prompts, the grammar, the engine's
        own checks. Its id is `kind-<hex>`."""
        model = self.check_model(req.model)
        self.check_runner_generates()
        params = self.sampling_params(req)
        prompts = await encode(model)
        grammar = await self.engine.check_grammar(params)
        transfer = KVTransferParams.from_request(req.kv_transfer_params, self.engine.config.kv_transfer)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        stream = self.engine.add_requests(request_id, prompts, params, arrival, req.cache_salt, grammar, transfer,
                                          self.loras.adapters.get(model))
        return Started(request_id, model, params, prompts, stream)
