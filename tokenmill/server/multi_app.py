"""The outer app of a server with several models: a thin ASGI dispatcher in front of one app per model.

A request that carries a model reads it from its JSON body's `model` (the default model, the first, when it gives
none), has the pool load that model if it is not loaded (waiting meanwhile), and is handed to the model's own app
with its body replayed, so every route behaves as it does with one model. The request counts as in flight on its
model until its response has ended, streams included. The dispatcher itself answers what is about all models:
GET /v1/models (every configured model with its `status`: unloaded, loading, loaded, unloading), GET
/v1/models/{id}, /health (ok while the server runs: a model whose engine died is unloaded and loads again at its next
request), /metrics (every loaded model's metrics and the pool's, server/pool_metrics.py) and /version.
GET/DELETE /v1/responses/{id} ask each loaded model's store in turn. Everything else (the playground at /, its
/ui/stats, /admin/*, /v1/kv_transfer) goes to the default model's app, without counting as its use (/ui/stats
answers "not loaded" itself rather than load it). The same Guard as a single model's (keys, body
size) stands in front.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import tokenmill
from tokenmill.server.asgi import replay
from tokenmill.server.errors import APIError, ModelNotFound, NotFound, classify_for
from tokenmill.server.guard import GENERATE_PATHS, Guard
from tokenmill.server.model_pool import ModelEntry, ModelPool
from tokenmill.server.pool_metrics import PoolMetrics
from tokenmill.server.settings import ServerSettings

# routes whose JSON body names the model
MODEL_BODY_PATHS = frozenset({*GENERATE_PATHS, "/v1/messages/count_tokens", "/tokenize", "/detokenize"})
OFF_LOOP_BYTES = 64 << 10  # a larger body is parsed for its `model` on a worker thread


def model_of(body: bytes) -> str | None:
    """The `model` a JSON body names, or None (no such field, not a string, not JSON: the model's app answers
    a malformed body as it would alone)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


async def read_body(receive: Any) -> bytes | None:
    """The whole request body, or None if the client left first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_json(send: Any, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class MultiModelApp:
    """The dispatcher (plain ASGI). Its lifespan starts the pool and loads the default model, so the server's ready
    line means the default model answers; at shutdown every model is unloaded."""

    def __init__(self, pool: ModelPool, settings: ServerSettings, metrics: PoolMetrics):
        self.pool, self.settings, self.metrics = pool, settings, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            return await send_json(send, 200, {"status": "ok", "models": {n: e.state for n, e in
                                                                          self.pool.entries.items()}})
        if method == "GET" and path == "/metrics":
            data = self.metrics.render()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", self.metrics.content_type.encode()),
                                    (b"content-length", str(len(data)).encode())]})
            return await send({"type": "http.response.body", "body": data})
        if method == "GET" and path == "/version":
            return await send_json(send, 200, {"version": tokenmill.__version__})
        if method == "GET" and path == "/v1/models":
            return await send_json(send, 200, {"object": "list",
                                               "data": [self.card(e) for e in self.pool.entries.values()]})
        if method == "GET" and path.startswith("/v1/models/"):
            entry = self.pool.get(path[len("/v1/models/"):])
            if entry is None:
                return await self.refuse(path, self.unknown(path[len("/v1/models/"):]), send)
            return await send_json(send, 200, self.card(entry))
        if method in ("GET", "DELETE") and path.startswith("/v1/responses/"):
            return await self.stored_response(scope, receive, send)
        if method == "POST" and path in MODEL_BODY_PATHS:
            body = await read_body(receive)
            if body is None:
                return
            name = await asyncio.to_thread(model_of, body) if len(body) > OFF_LOOP_BYTES else model_of(body)
            entry = self.pool.default if name is None else self.pool.get(name)
            if entry is None:
                return await self.refuse(path, self.unknown(name), send)
            return await self.dispatch(entry, scope, replay(body, receive), send)
        if method == "GET" and path == "/ui/stats" and self.pool.default.state != "loaded":
            # the dashboard polls every second: that alone must not keep loading an unloaded default model
            default = self.pool.default
            return await send_json(send, 200, {"model": default.name, "time": time.time(), "healthy": False,
                                               "status": default.state})
        # not about one model: the default one's app (the dashboard's polling does not count as its use)
        return await self.dispatch(self.pool.default, scope, receive, send, touch=method not in ("GET", "HEAD"))

    async def dispatch(self, entry: ModelEntry, scope: dict, receive: Any, send: Any, touch: bool = True) -> None:
        """Hand the request to `entry`'s app once it is loaded; in flight there until its response has ended."""
        try:
            entry = await self.pool.acquire(entry.name, touch)
        except APIError as exc:  # no room within the wait, a failed load, too large for --memory-limit
            return await self.refuse(scope["path"], exc, send)
        app = entry.loaded.app  # taken now: a dying engine's entry lets go of it while this request ends
        try:  # a copy: the model's app writes itself into the scope, which uvicorn keeps until the connection's next
            await app(dict(scope), receive, send)  # request (it would hold an unloaded model's engine until then)
        finally:
            self.pool.release(entry, touch)

    async def stored_response(self, scope: dict, receive: Any, send: Any) -> None:
        """A stored response lives in the store of the model that made it: ask each loaded model's app until one
        answers other than 404 (a model unloaded since has lost its store)."""
        for entry in list(self.pool.entries.values()):
            if entry.state != "loaded":
                continue
            held: list[dict] = []

            async def capture(message: dict) -> None:
                held.append(message)

            await self.dispatch(entry, scope, receive, capture, touch=False)
            if held and held[0].get("status") != 404:
                for message in held:
                    await send(message)
                return
        response_id = scope["path"].rsplit("/", 1)[1]
        await self.refuse(scope["path"], NotFound(f"no stored response {response_id!r}", param="response_id"), send)

    def card(self, entry: ModelEntry) -> dict:
        loaded = entry.loaded
        return {"id": entry.name, "object": "model", "created": self.settings.created, "owned_by": "tokenmill",
                "root": entry.path, "parent": None,
                "max_model_len": loaded.max_model_len if loaded is not None else None,
                "default": entry is self.pool.default, **entry.card()}

    def unknown(self, name: str) -> ModelNotFound:
        names = ", ".join(map(repr, self.pool.entries))
        return ModelNotFound(f"the model {name!r} does not exist; this server serves {names}", param="model")

    async def refuse(self, path: str, exc: Exception, send: Any) -> None:
        status, body = classify_for(path, exc)
        self.metrics.on_rejected(status)
        headers = [(b"retry-after", b"1")] if status in (429, 503) else []
        await send_json(send, status, body, headers)

    async def lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.pool.start()
                    entry = await self.pool.acquire(self.pool.default.name)
                    self.pool.release(entry)
                except Exception as exc:
                    await self.pool.close()
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_multi_app(pool: ModelPool, settings: ServerSettings) -> tuple[Guard, PoolMetrics]:
    """The dispatcher behind the same Guard a single model's app has (keys, body size; the per-model load
    shedding is each model's own guard's, behind this one)."""
    metrics = PoolMetrics(pool)
    app = MultiModelApp(pool, settings, metrics)
    return Guard(app, settings=settings, on_reject=metrics.on_rejected, overloaded=lambda: None), metrics
