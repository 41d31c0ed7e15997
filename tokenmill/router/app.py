"""`tokenmill router`: the OpenAI API in front of many replicas (tokenmill, vLLM, llama.cpp's server: anything that
speaks it). Each request goes to the replica the policy picks (router/policies.py); bodies and streams pass through
byte for byte.

- `--backend URL` (repeat) names the replicas; `--policy` prefix | least_load | round_robin places requests;
  `--prefill URL --decode URL` (repeat) runs the prefill/decode proxy instead (router/pd_proxy.py), `--cascade
  NAME=URL` (repeat, with `--tier-price`, `--escalate-below`, `--cascade-first-tokens`) a cascade (router/climb.py).
- A replica that cannot be reached, or answers 502/503 (gone, shutting down) or 429 (its queue is full), before
  the response has begun, is skipped and the request goes to the next one (up to --max-attempts replicas); a
  replica that fails a request is taken out until its health check passes again (every --health-interval s).
- A stream whose replica fails midway ends with an error event and `[DONE]`, never a hang; a client that goes away
  closes the upstream request, so the replica aborts it and frees its blocks.
- Keys (router/guard.py; all compared in constant time): `--api-key` guards /v1/*; `--admin-api-key` alone opens
  /admin/* (without it the admin endpoints are off: 404); `--metrics-api-key`, when given, guards /metrics;
  `--backend-api-key` is what the router sends to the replicas. Each also reads its $TOKENMILL_* variable.
- Bounds: a body over `--max-request-bytes` (default 16 MiB) is refused with 413 while it arrives, on every route;
  past `--max-connections` client requests at once (default 1024) a new one gets 429 with Retry-After; the
  connections toward the replicas are pooled and bounded by the same number.
- A request naming a `model` goes only to replicas whose /v1/models lists it (read at each health check; 404
  model_not_found when no healthy replica does); GET /v1/models lists every model of the healthy replicas.
- /health: 200 while a replica is healthy. /metrics: requests by replica and outcome, retries, replicas' health,
  load and in-flight counts. /admin/backends: GET lists, POST {"url"} adds, DELETE {"url"} removes, at run time.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.router.admin import add_admin_routes
from tokenmill.router.cascade import CascadeConfig
from tokenmill.router.climb import Climber
from tokenmill.router.disagg import PDConfig
from tokenmill.router.errors import error_response
from tokenmill.router.forward import Forwarder, Job, requested_model, routing_key
from tokenmill.router.guard import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
    GuardSettings,
    RouterGuard,
)
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.pd_proxy import PDProxy
from tokenmill.router.policies import reads_prompt
from tokenmill.router.replicas import ReplicaPool
from tokenmill.router.status import add_status_routes

__all__ = ["CascadeConfig", "build_router_app", "run_router"]


def backend_limits(max_connections: int) -> httpx.Limits:
    """Connections toward the replicas: a client request holds at most one at a time, so --max-connections of
    them (and a few for the router's own calls) are never waited for."""
    return httpx.Limits(max_connections=max_connections + 8, max_keepalive_connections=min(64, max_connections))


def backend_client(api_key: str | None, max_connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(headers=headers, limits=backend_limits(max_connections),
                             timeout=httpx.Timeout(None, connect=5.0, pool=30.0))


def build_router_app(pool: ReplicaPool, policy: Any, guard: GuardSettings | None = None,
                     backend_api_key: str | None = None, max_attempts: int = 3, cascade: CascadeConfig | None = None,
                     pd: PDConfig | None = None) -> FastAPI:
    """The router's app over `pool`; with `pd`, `pool` is the decode instances and `pd.prefill` the prefill ones."""
    guard = guard or GuardSettings()
    metrics = RouterMetrics(pool, pd.prefill if pd is not None else None)
    state: dict[str, httpx.AsyncClient] = {}
    index = getattr(policy, "index", None)
    if index is not None:
        pool.on_removed = index.forget

    def client() -> httpx.AsyncClient:
        return state["client"]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["client"] = backend_client(backend_api_key, guard.max_connections)
        pools = [pool] + ([pd.prefill] if pd is not None else [])
        for p in pools:
            p.start()
        try:
            yield
        finally:
            for p in pools:
                await p.stop()
            await state["client"].aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.add_middleware(RouterGuard, settings=guard)
    app.add_exception_handler(Exception, internal_error)
    forwarder = Forwarder(pool, policy, metrics, client, max_attempts)
    climber = Climber(cascade, pool, metrics, client) if cascade is not None else None
    pd_proxy = PDProxy(pd, pool, policy, forwarder, metrics, client, max_attempts) if pd is not None else None

    async def one_replica(body: bytes, path: str) -> Response:
        """To one replica, as the policy places the request."""
        return forwarder.respond(Job(body, path, await routing_key(body, reads_prompt(policy)),
                                     model=await requested_model(body)))

    async def generate(request: Request, path: str, chat: bool) -> Response:
        body = await request.body()  # read by the guard, within --max-request-bytes
        if climber is not None:
            return await climber.handle(body, path, chat)
        if pd_proxy is not None:
            return await pd_proxy.handle(body, path)
        return await one_replica(body, path)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions", chat=True)

    async def forward(request: Request, path: str) -> Response:
        """A request no cascade or P/D split applies to (Anthropic's Messages API, embeddings)."""
        return await one_replica(await request.body(), path)

    @app.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> Response:
        return await forward(request, "/v1/messages")

    @app.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(request: Request) -> Response:
        return await forward(request, "/v1/messages/count_tokens")

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(request: Request) -> Response:
        return await forward(request, "/v1/embeddings")

    add_status_routes(app, pool, pd, metrics, client)
    add_admin_routes(app, pool)
    return app


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: said as such in the OpenAI shape, without internals (the traceback goes to the log)."""
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


class RouterServer(uvicorn.Server):
    """Prints one ready line, with the port it really bound."""

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for srv in self.servers:
                for sock in srv.sockets:
                    port = sock.getsockname()[1]
            print(f"tokenmill router at http://{self.config.host}:{port}", flush=True)


def run_router(backends: list[str], policy: str, host: str, port: int, api_key: str | None,
               backend_api_key: str | None, health_interval_s: float, max_attempts: int,
               cascade: CascadeConfig | None = None, prefill: list[str] | None = None, *,
               admin_api_key: str | None = None, metrics_api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_connections: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """`backends` are the replicas (with `prefill`: the decode instances), or the cascade's tiers."""
    from tokenmill.router.policies import make_policy

    try:
        guard = GuardSettings(api_key or None, admin_api_key or None, metrics_api_key or None, max_request_bytes,
                              max_connections)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pool = ReplicaPool(backends or [t.url for t in cascade.tiers], backend_api_key, health_interval_s)
    pd = PDConfig(ReplicaPool(prefill, backend_api_key, health_interval_s), make_policy(policy)) if prefill else None
    app = build_router_app(pool, make_policy(policy), guard, backend_api_key, max_attempts, cascade, pd)
    server = RouterServer(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    server.run()
    return 0
